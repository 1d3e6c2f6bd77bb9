"""The student: trained on the node from the store, within its memory, when the CPU is idle.

Memory (paper §VI). :func:`plan_batch` finds the largest batch whose training step fits the
device budget at the chosen recompute factor ρ: for each batch, the model's chain from shapes
(``edgetrain.analytic_chain``), the least-memory plan within ρ
(``plan_for_device(..., max_recompute=ρ)``), and the whole step's memory
(``fixed_training_bytes`` — weights, gradients, optimizer state, buffers, input — plus the plan's
activation peak). The step then runs that plan in :class:`edgetrain.Checkpointed`.

Staying out of the way. The trainer lowers its own priority (nice 19 and ``SCHED_IDLE`` where
allowed, every thread) and, before each step, measures the CPU time other processes used since the
last check; above ``idle_threshold`` (a fraction of all cores) it pauses until the machine is quiet.

Resuming. Every ``checkpoint_every`` steps (and when time runs out) the model, the optimizer, the
step, the epoch and position in it, the random-number state and the list of training images are
written atomically with a checksum (``student.ckpt``). A run killed at any moment loses at most
``checkpoint_every`` steps; resumed, it ends with the same weights as an uninterrupted run
(the data order of each epoch is a seeded permutation of the snapshot taken at the start).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import psutil
import torch
from torch import nn

import edgetrain
from edgetrain.autograd import StorageCounter, storage_bytes
from edgetrain.core import Schedule, fixed_training_bytes
from edgetrain.errors import CorruptFile, InfeasibleBudget, InvalidInput
from edgetrain.insitu.files import load_failure, load_state, save_state
from edgetrain.insitu.network import INPUT, classifier, to_input
from edgetrain.insitu.store import Store, StoreError, UnreadableImage, count_reasons
from edgetrain.planners import plan_for_device
from edgetrain.units import format_bytes

CHECKPOINT = "student.ckpt"
CHECKPOINT_KEYS = ("model", "optimizer", "step", "rng", "ids", "config", "total_steps")
"""What a student checkpoint holds (a teacher's cached state, copied over it, does not)."""
OPTIMIZER = "momentum"  # SGD with momentum: one state tensor per parameter


@dataclass(frozen=True)
class TrainConfig:
    """How the student trains. ``memory_bytes`` is the device budget for the training step."""

    memory_bytes: int = 2 * 1024**3
    recompute: float = 1.25
    max_batch: int = 32
    epochs: int = 4
    lr: float = 0.01
    seed: int = 0
    checkpoint_every: int = 10
    threads: int = 1
    idle_threshold: float = 0.75
    low_priority: bool = True


@dataclass(frozen=True)
class BatchPlan:
    """The batch :func:`plan_batch` chose and what its step costs (bytes)."""

    batch: int
    largest_fitting: int  # the largest batch that fits, before the max_batch cap (>= batch)
    schedule: Schedule
    chain: edgetrain.Chain
    fixed_bytes: int  # weights, gradients, optimizer state, buffers, input
    activation_bytes: int  # the plan's activation peak
    recompute_factor: float

    @property
    def predicted_peak_bytes(self) -> int:
        return self.fixed_bytes + self.activation_bytes


@dataclass(frozen=True)
class TrainResult:
    """Where training stands after a run (steps counted from the very first run)."""

    step: int
    total_steps: int
    epoch: int
    batch: int
    images: int
    skipped_images: int
    predicted_peak_bytes: int
    measured_peak_bytes: int  # 0 when no step ran in this run
    paused_seconds: float
    seconds: float
    resumed_from: int
    last_loss: float
    skipped_rows: dict[str, int] = field(default_factory=dict)  # reason -> rows skipped

    @property
    def finished(self) -> bool:
        return self.step >= self.total_steps


def plan_at(model: nn.Sequential, batch: int, config: TrainConfig) -> BatchPlan:
    """The plan within ρ for ``batch`` and what the whole step costs (from shapes alone)."""
    sample = torch.empty(batch, 3, INPUT, INPUT, device="meta")
    chain = edgetrain.analytic_chain(model, sample)
    fixed = fixed_training_bytes(chain, OPTIMIZER)
    schedule = plan_for_device(
        chain, "optimal", device_bytes=None, fixed_bytes=fixed, max_recompute=config.recompute
    )
    cost = edgetrain.simulate(chain, schedule)
    return BatchPlan(batch, batch, schedule, chain, fixed, cost.peak_bytes, cost.recompute_factor)


def plan_batch(
    model: nn.Sequential, config: TrainConfig, *, find_largest: bool = False
) -> BatchPlan:
    """The largest batch up to ``max_batch`` whose step fits ``memory_bytes`` at ρ.

    With ``find_largest`` also the largest batch that fits without the cap (``largest_fitting``;
    otherwise it is the chosen batch).
    """

    def fits(b: int) -> BatchPlan | None:
        p = plan_at(model, b, config)
        return p if p.predicted_peak_bytes <= config.memory_bytes else None

    capped = fits(config.max_batch)
    if capped is not None and not find_largest:
        return capped
    if fits(1) is None:
        need = plan_at(model, 1, config).predicted_peak_bytes
        raise InfeasibleBudget(
            f"the student needs {format_bytes(need)} for a batch of 1 at recompute factor "
            f"{config.recompute}; give more --memory",
            need,
        )
    # The step's bytes are affine in the batch (every activation scales with it): start from
    # the line through batches 1 and 2, then check the neighbours with the planner itself.
    one, two = plan_at(model, 1, config), plan_at(model, 2, config)
    slope = max(1, two.predicted_peak_bytes - one.predicted_peak_bytes)
    low = max(1, 1 + (config.memory_bytes - one.predicted_peak_bytes) // slope)
    while low > 1 and fits(low) is None:
        low -= 1
    while fits(low + 1) is not None:
        low += 1
    chosen = capped if capped is not None else fits(min(low, config.max_batch))
    assert chosen is not None
    return BatchPlan(
        chosen.batch,
        low,
        chosen.schedule,
        chosen.chain,
        chosen.fixed_bytes,
        chosen.activation_bytes,
        chosen.recompute_factor,
    )


def lower_priority() -> str:
    """Nice 19 and SCHED_IDLE for every thread of this process, as far as allowed."""
    done = []
    tids = (
        [int(t) for t in os.listdir("/proc/self/task")] if Path("/proc/self/task").exists() else [0]
    )
    try:
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        done.append("nice 19")
    except (OSError, AttributeError):
        pass
    try:
        for tid in tids:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        done.append("SCHED_IDLE")
    except (OSError, AttributeError):
        pass
    return ", ".join(done) or "normal priority (not allowed to lower it)"


class IdleGate:
    """Is the CPU otherwise idle? Other processes' share of all cores since the last check."""

    def __init__(self, threshold: float, *, interval: float = 0.5) -> None:
        self.threshold = threshold
        self.interval = interval
        self.me = psutil.Process()
        self.cores = psutil.cpu_count() or 1
        self._last = self._sample()
        self.others = 0.0

    def _sample(self) -> tuple[float, float, float]:
        cpu = psutil.cpu_times()
        # Linux counts guest time inside user time: leave guest fields out of the sum.
        busy = (
            cpu.user
            + cpu.system
            + sum(getattr(cpu, name, 0.0) for name in ("nice", "irq", "softirq", "steal"))
        )
        mine = self.me.cpu_times()
        return time.monotonic(), busy, mine.user + mine.system

    def busy(self) -> bool:
        """True when others used more than the threshold since the last measurement."""
        now = self._sample()
        wall = now[0] - self._last[0]
        if wall < self.interval:
            return self.others > self.threshold
        others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2]))
        self.others = others / (wall * self.cores)
        self._last = now
        return self.others > self.threshold


class _Data:
    """The training images (decoded once, at the classifier's input size) and their labels;
    ``skipped`` holds the reason of each row skipped (see :meth:`Store.rows`) and of each image
    that fails when read."""

    def __init__(self, store: Store, ids: list[int], classes: int) -> None:
        rows, skipped = store.rows(classes)
        by_id = {r.id: r for r in rows}
        self.problems = [str(s) for s in skipped]
        self.skipped = [s.reason for s in skipped]
        self.images: dict[int, np.ndarray] = {}
        self.labels: dict[int, int] = {}
        for i in ids:
            row = by_id.get(i)
            if row is None:
                self.problems.append(f"image {i} is gone from the store (evicted or malformed)")
                continue
            try:
                image = store.read(row)
            except UnreadableImage as exc:
                self.problems.append(str(exc))
                self.skipped.append(exc.reason)
                continue
            self.images[i] = cv2.resize(image, (INPUT, INPUT), interpolation=cv2.INTER_AREA)
            self.labels[i] = row.label

    def batch(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        present = [i for i in ids if i in self.images]
        x = to_input([self.images[i] for i in present])
        return x, torch.tensor([self.labels[i] for i in present], dtype=torch.long)


def _order(seed: int, epoch: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=generator).tolist()


def student_model(classes: int, teacher_state: dict[str, torch.Tensor]) -> nn.Sequential:
    """The student: the teacher's architecture, starting from the teacher's weights."""
    model = classifier(classes)
    model.load_state_dict(teacher_state)
    return model


@contextmanager
def _restoring(path: Path) -> Iterator[None]:
    """Turn any failure to restore state from the checkpoint ``path`` (a value of the wrong
    kind or shape: a checkpoint of another model or version) into one :class:`CorruptFile`
    line."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise CorruptFile(
            f"{path} does not fit the student ({load_failure(exc)}); delete it to start over"
        ) from exc


def load_student(directory: Path, classes: int) -> tuple[nn.Sequential, dict[str, Any]]:
    """The student's latest weights from a store's checkpoint (eval mode) and the checkpoint."""
    state = load_state(directory / CHECKPOINT, CHECKPOINT_KEYS)
    model = classifier(classes)
    with _restoring(directory / CHECKPOINT):
        model.load_state_dict(state["model"])
        int(state["step"]), int(state["total_steps"])  # what the report reads: whole numbers
    model.eval()
    return model, state


def train_student(
    store: Store,
    classes: int,
    teacher_state: dict[str, torch.Tensor],
    config: TrainConfig,
    *,
    deadline: float | None = None,
    on_step: Callable[[int, int, float, bool], None] | None = None,
) -> TrainResult:
    """Train (or resume training) the student from ``store`` until done or ``deadline``.

    ``on_step(step, total, loss, paused)`` reports progress. Raises :class:`StoreError` for an
    empty store and :class:`CorruptFile` for a checkpoint that fails its check.
    """
    torch.set_num_threads(config.threads)
    path = store.directory / CHECKPOINT
    state: dict[str, Any] | None = load_state(path, CHECKPOINT_KEYS) if path.exists() else None
    model = student_model(classes, teacher_state)
    if state is not None:
        with _restoring(path):
            saved = dict(state["config"])
        for key in ("seed", "lr", "recompute", "epochs", "max_batch", "memory_bytes"):
            if saved.get(key) != getattr(config, key):
                raise InvalidInput(
                    f"the store's student was trained with {key}={saved.get(key)}, not "
                    f"{getattr(config, key)}; use the same settings or a new --store"
                )
        with _restoring(path):
            ids = [int(i) for i in state["ids"].tolist()]
    else:
        rows, _ = store.rows(classes)
        ids = [r.id for r in rows]
    if not ids:
        raise StoreError(
            f"the store {store.directory} has no labelled images to train on; run "
            "`edgetrain insitu run` on more video first"
        )
    data = _Data(store, ids, classes)
    if not data.images:
        raise StoreError(f"none of the store's {len(ids)} images is readable; see the report")
    plan = plan_batch(model, config)
    batch = min(plan.batch, len(ids))
    if batch != plan.batch:
        plan = plan_at(model, batch, config)
    per_epoch = max(1, len(ids) // batch)
    total = per_epoch * config.epochs
    state_bytes = fixed_training_bytes(plan.chain, OPTIMIZER) - fixed_training_bytes(plan.chain)
    sample = torch.zeros(batch, 3, INPUT, INPUT)
    net = edgetrain.Checkpointed(
        model,
        sample,
        memory_budget=config.memory_bytes,
        reserve_bytes=state_bytes,
        chain=plan.chain,
        schedule=plan.schedule,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=config.lr, momentum=0.9)
    step = 0
    if state is not None:
        with _restoring(path):
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            step = int(state["step"])
            torch.set_rng_state(state["rng"])
    else:
        torch.manual_seed(config.seed)
    resumed_from = step
    if config.low_priority:
        lower_priority()
    gate = IdleGate(config.idle_threshold)
    began = time.monotonic()
    paused = 0.0
    measured = 0
    loss_value = float("nan")
    loss_fn = nn.CrossEntropyLoss()
    model.train()

    def checkpoint() -> None:
        save_state(
            path,
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "epoch": step // per_epoch,
                "position": (step % per_epoch) * batch,
                "rng": torch.get_rng_state(),
                "ids": torch.tensor(ids, dtype=torch.int64),
                "config": asdict(config),
                "batch": batch,
                "total_steps": total,
            },
        )

    while step < total:
        if deadline is not None and time.monotonic() >= deadline:
            break
        if config.idle_threshold < 1.0 and gate.busy():
            start_pause = time.monotonic()
            while gate.busy() and (deadline is None or time.monotonic() < deadline):
                if on_step is not None:
                    on_step(step, total, loss_value, True)
                time.sleep(0.25)
            paused += time.monotonic() - start_pause
            continue
        epoch, position = divmod(step, per_epoch)
        order = _order(config.seed, epoch, len(ids))
        x, y = data.batch([ids[k] for k in order[position * batch : (position + 1) * batch]])
        if len(y) == 0:
            step += 1
            continue
        opt.zero_grad()
        if measured == 0 and len(y) == batch and step > resumed_from:
            held = [
                *params,
                *model.buffers(),
                x,
                y,
                *(p.grad for p in params if p.grad is not None),
            ]
            held += [
                v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
            ]
            before = storage_bytes(held)
            counter = StorageCounter()
            with counter:
                loss = loss_fn(net(x), y)
                loss.backward()
            measured = before + counter.peak_bytes
        else:
            loss = loss_fn(net(x), y)
            loss.backward()
        opt.step()
        loss_value = float(loss.item())
        step += 1
        if step % config.checkpoint_every == 0 or step == total:
            checkpoint()
        if on_step is not None:
            on_step(step, total, loss_value, False)
    if step % config.checkpoint_every != 0 and step != total:
        checkpoint()
    return TrainResult(
        step=step,
        total_steps=total,
        epoch=step // per_epoch,
        batch=batch,
        images=len(data.images),
        skipped_images=len(ids) - len(data.images),
        predicted_peak_bytes=net.predicted_peak_bytes + state_bytes,
        measured_peak_bytes=measured,
        paused_seconds=paused,
        seconds=time.monotonic() - began,
        resumed_from=resumed_from,
        last_loss=loss_value,
        skipped_rows=count_reasons(data.skipped),
    )


__all__ = [
    "BatchPlan",
    "IdleGate",
    "StoreError",
    "TrainConfig",
    "TrainResult",
    "load_student",
    "lower_priority",
    "plan_at",
    "plan_batch",
    "train_student",
]
