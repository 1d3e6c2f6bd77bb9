"""Any-model benchmark: what a PyTorch user can do today to train in less memory, side by side.

For each model (built from code, not nn.Sequential: residuals, long skips, attention, tied
weights), one training step (forward, mean-square loss, backward; gradients then set to None):

* ``plain``: eager autograd; ``plain (again)``: the same step again, timed in the same rounds
  (its ratio to ``plain`` is the resolution of every time ratio of the model).
* ``checkpoint``: ``torch.utils.checkpoint.checkpoint(block, use_reentrant=False)`` around every
  block (residual block, inverted residual, U-Net double convolution, transformer block);
  ``checkpoint-selective``: the same blocks under torch's selective activation checkpointing,
  saving convolution, matrix-product and attention outputs and recomputing the rest (eager's
  counterpart of what compile's partitioner does, see :data:`SELECTIVE`).
* ``compile@b``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = b``
  (b = 1.0, 0.5, 0.3, 0.1): the min-cut partitioner with a knapsack over what to save. The first
  call compiles (``compile_s``, reported apart; inductor's on-disk caches make a second run
  fast; ``--no-compile`` skips these rows).
* ``edgetrain@f``: the model captured, cut and profiled once (:class:`Edgetrain`), planned for
  f × plain's measured peak; ``edgetrain@store-all`` for the store-all plan's predicted peak;
  ``edgetrain≤compile@b``: the fastest plan whose measured peak is within compile@b's measured
  peak (planned for that peak; when it measures over, the planner's budget searched by
  measuring each candidate; see :func:`_fit`). Every plan is made for the whole step, the loss
  merged into the chain's last stage (``with_loss``): predicted peaks are the step's.

Memory: ``peak_MiB`` is the most heap memory in use during the step above what was in use when
it started (weights, buffers, input; parameter gradients are allocated during the step and
included), measured by glibc's ``mallinfo2`` sampled in a thread (``_malloc_peak.py``) — one
method for every row, compiled code included (a dispatch mode does not see inside compiled
graphs). Maximum over ``--mem-repeats`` runs (sampling can only miss a peak: 30 readings each
of plain ViT-Tiny and two edgetrain plans missed the top by 0.1-2 MiB in 6 to 11 of 30: 3
runs all miss it with a probability of 1-5 %, 7 runs under 0.1 %). For eager rows
``counter_MiB`` is ``StorageCounter``'s exact figure.

Time: process CPU time (``cpu``, what the verdicts judge) and wall time of each step, in
interleaved rounds (every configuration of a model once per round, each round in a shuffled
order). torch and inductor's kernels run one thread and compiles run in this process, so other
jobs on a shared machine stretch the wall clock more than the CPU time; they still move the CPU
time of a step by up to 40 % between rounds minutes apart. So every ratio is *paired*: the
median over rounds of a row's step over the reference's step in the same round (``cpu/plain``;
``cpu/compile@1``: a compiled row's step over the budget-1.0 compiled step, what compile pays
for its memory). ``cpu_s`` and ``wall_s`` are plain medians.

Verdicts, per model and compile budget b: ``edgetrain≤compile@b``'s peak ≤
compile@b's, and its overhead (cpu over plain's) ≤ compile's (compile@b over compile@1); and
``edgetrain@store-all`` within 1.03 × plain.

    python benchmarks/anymodel.py --json > run.json   # five models, compiles take minutes each
    python benchmarks/anymodel.py --compile-json run.json   # edgetrain rows again, no compiling
    python benchmarks/anymodel.py --no-compile --models resnet101-module:8:224 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, interleaved_samples, paired_ratio, sample_medians
from _malloc_peak import malloc_peak, release_free_memory

from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.core.chain import Chain
from edgetrain.core.loss import with_loss
from edgetrain.core.schedule import Schedule
from edgetrain.core.simulator import Cost, simulate
from edgetrain.errors import EdgetrainError, InfeasibleBudget
from edgetrain.frontend.loss import profile_loss
from edgetrain.models import build, canonical_name, sample_input
from edgetrain.models.mobilenetv2 import InvertedResidual
from edgetrain.models.resnet import BasicBlock, Bottleneck
from edgetrain.models.transformer import Block
from edgetrain.models.unet import UNet
from edgetrain.planners.optimal import store_all
from edgetrain.runtime.prepared import STAGE_SECONDS

MiB = 2**20
COMPILE_BUDGETS = (1.0, 0.5, 0.3, 0.1)
EDGETRAIN_BUDGETS = (1.0, 0.7, 0.5, 0.3)  # fractions of plain autograd's measured peak
# name: (batch, size) — size is the image side, or the sequence length for tinylm.
DEFAULT_MODELS = {
    "resnet50-module": (4, 128),
    "mobilenetv2": (8, 128),
    "unet": (4, 128),
    "vit-tiny": (8, 128),
    "tinylm": (8, 256),
}

Step = Callable[[torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# EDGETRAIN. The model is captured and cut into stages (between and inside its blocks) and
# profiled once on this machine (:class:`Edgetrain`); every edgetrain row plans on that one chain
# with the step's loss merged into its last stage (``with_loss``), so that a plan's predicted
# peak is the whole step's: ``peak_MiB`` is the step's peak above weights, buffers and input,
# parameter gradients created during the step included (the loop here sets them to None), and
# the loss is computed by the caller between the forward and the backward.
# ---------------------------------------------------------------------------------------------
def _loss(out: torch.Tensor) -> torch.Tensor:
    """The step's loss: the mean of the output's squares."""
    return out.float().square().mean()


class Edgetrain:
    """One model's profiled chain, and the chain with the loss to plan rows on."""

    def __init__(self, base: nn.Module, x: torch.Tensor, chain: Chain | None = None) -> None:
        """``chain``: the model's chain when already made (else profiled here)."""
        from edgetrain.runtime.checkpointed import Checkpointed

        self.base, self.x = base, x
        start = time.perf_counter()
        if chain is None:
            chain = Checkpointed(copy.deepcopy(base), x).chain  # stores everything: profiles
        self.chain = chain
        with torch.no_grad():
            self.loss = profile_loss(_loss, base(x))
        self.planning = with_loss(self.chain, self.loss)
        self.profile_s = time.perf_counter() - start

    def plan(self, heap_bytes: int) -> Schedule:
        """The fastest plan for a step peak (loss included) of ``heap_bytes``. Raises
        ``InfeasibleBudget`` when no plan fits."""
        from edgetrain.core.schedule import made_for
        from edgetrain.planners import plan

        return made_for(plan(self.planning, "optimal", memory=heap_bytes), self.chain)

    def checkpointed(self, schedule: Schedule, target: int | None = None) -> Any:
        """A ``Checkpointed`` copy of the model running ``schedule``; ``target``: the step peak
        (bytes) the plan was searched for (:func:`_fit`), up to which the executor may run
        stages as one graph that holds a little more than the plan (else the planner's budget).
        The executor sizes the model's step without the loss, so this lets one graph's extra
        fall where the loss is held too: :func:`_fit` keeps only plans whose measured step,
        loss included, is within the target."""
        from edgetrain.runtime.checkpointed import Checkpointed

        if target is not None:
            params = {**schedule.params, "budget_bytes": target}
            schedule = Schedule(
                schedule.length, schedule.kinds, schedule.indices, schedule.strategy, params
            )
        return Checkpointed(copy.deepcopy(self.base), self.x, chain=self.chain, schedule=schedule)

    def net(self, heap_bytes: int) -> Any:
        """A ``Checkpointed`` copy of the model with :meth:`plan`'s plan for ``heap_bytes``."""
        return self.checkpointed(self.plan(heap_bytes))

    def predicted(self, schedule: Schedule) -> Cost:
        """The whole step's cost under ``schedule``, loss included."""
        return simulate(self.planning, schedule)

    def least_bytes(self) -> int:
        """The least step peak any plan has."""
        try:
            return int(self.predicted(self.plan(1)).peak_bytes)
        except InfeasibleBudget as exc:
            if exc.smallest is None:
                raise
            return int(exc.smallest)


def checkpoint_blocks(model: nn.Module, *, selective: bool = False) -> nn.Module:
    """``model`` with every block wrapped in non-reentrant ``torch.utils.checkpoint``; with
    ``selective``, torch's selective activation checkpointing (:data:`SELECTIVE`)."""
    kinds = (BasicBlock, Bottleneck, InvertedResidual, Block)
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, kinds)
    ]
    for unet in [m for m in model.modules() if isinstance(m, UNet)]:  # its double convolutions
        targets.append((unet, "bottom"))
        targets += [(group, str(i)) for group in (unet.down, unet.merge) for i in range(len(group))]
    for parent, name in targets:
        setattr(parent, name, _Checkpoint(getattr(parent, name), selective))
    return model


SELECTIVE = (
    torch.ops.aten.convolution.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)
"""What ``checkpoint-selective`` saves inside a block: the outputs of convolutions, matrix
products and attention (what ``torch.compile``'s partitioner prefers to save); everything else
(normalisation, activations, additions) is recomputed in the backward. This is torch's eager
counterpart of compile's choice (``create_selective_checkpoint_contexts``); like plain
``checkpoint`` it updates BatchNorm's running statistics again when it recomputes
(pytorch#96136), which does not change its time or memory."""


def _selective_policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


class _Checkpoint(nn.Module):
    def __init__(self, inner: nn.Module, selective: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.selective = selective

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.selective:
            contexts = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            out: torch.Tensor = checkpoint(
                self.inner, *args, use_reentrant=False, context_fn=contexts
            )
            return out
        out = checkpoint(self.inner, *args, use_reentrant=False)
        return out


def _training_step(net: Step, params: list[nn.Parameter], x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        _loss(net(x)).backward()
        for p in params:  # as zero_grad() would; after the step, so each starts without them
            p.grad = None

    return step


def bench_model(
    name: str,
    batch: int,
    size: int,
    args: argparse.Namespace,
    reused: dict[str, dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of one model and its verdicts. ``reused``: compile rows of this model from an
    earlier run (``--compile-json``), by config; budgets not in it are compiled here."""
    torch.manual_seed(0)
    label = f"{name} b{batch} {size}"
    base = build(name, image=size)
    x = sample_input(name, batch, size)
    configs: dict[str, Callable[[], None]] = {}
    nets: dict[str, Any] = {}  # edgetrain config -> its Checkpointed
    alias: dict[str, str] = {}  # edgetrain config -> the config with the same plan (timed once)
    notes: dict[str, str] = {}
    compile_s: dict[str, float] = {}
    peaks: dict[str, int] = {}
    counted: dict[str, int] = {}
    planned: dict[str, int] = {}  # edgetrain config -> the heap budget its plan was made for

    def add(config: str, net: Step, params: list[nn.Parameter]) -> Callable[[], None]:
        configs[config] = _training_step(net, params, x)
        return configs[config]

    plain = copy.deepcopy(base)
    add("plain", plain, list(plain.parameters()))
    # The same step again, timed in the same rounds: how far apart two identical
    # configurations' medians land, the resolution of every ratio in the table.
    again = copy.deepcopy(base)
    add("plain (again)", again, list(again.parameters()))
    ckpt = checkpoint_blocks(copy.deepcopy(base))
    add("checkpoint", ckpt, list(ckpt.parameters()))
    selective = checkpoint_blocks(copy.deepcopy(base), selective=True)
    add("checkpoint-selective", selective, list(selective.parameters()))
    compiled: list[str] = []
    for budget in args.budgets if args.compile else ():
        config = f"compile@{budget:g}"
        if config in reused:
            continue
        model = copy.deepcopy(base)
        # A subclass of its own per budget: dynamo guards on the module's type, so this copy is
        # compiled afresh (a plain copy would reuse the first budget's graphs).
        model.__class__ = type(f"{type(base).__name__}_budget_{budget:g}", (type(base),), {})
        step = add(config, torch.compile(model), list(model.parameters()))
        _progress(f"{name}: compiling at activation_memory_budget={budget:g}")
        start = time.perf_counter()
        with torch._functorch.config.patch(activation_memory_budget=budget):
            step()  # compiles forward and backward with this budget
        compile_s[config] = time.perf_counter() - start
        compiled.append(config)

    def measure(config: str) -> None:
        configs[config]()  # warm-up (and, for compiled rows, any lazy backward compile)
        peaks[config] = max(malloc_peak(configs[config]) for _ in range(args.mem_repeats))
        if not config.startswith("compile"):  # a dispatch mode sees eager tensors only
            counter = StorageCounter()
            with counter:
                configs[config]()
            counted[config] = counter.peak_bytes

    for config in list(configs):
        measure(config)
    compile_peaks = {c: peaks[c] for c in compiled}
    compile_peaks.update({c: round(row["peak_MiB"] * MiB) for c, row in reused.items()})

    edgetrain: Edgetrain | None = None
    if args.edgetrain:
        _progress(f"{name}: profiling for edgetrain")
        edgetrain = Edgetrain(copy.deepcopy(base), x)

        def add_edgetrain(config: str, heap: int) -> bool:
            """Plan for ``heap``; False (and a note) if nothing fits."""
            try:
                net = edgetrain.net(heap)
            except EdgetrainError as exc:
                notes[config] = str(exc)
                return False
            add_net(config, net, heap)
            return True

        known: dict[str, tuple[Schedule, int, int, int]] = {}  # every plan measured: see _fit

        def add_net(config: str, net: Any, heap: int) -> None:
            planned[config] = heap
            nets[config] = net
            text = net.schedule.text()
            same = [c for c, n in nets.items() if c != config and n.schedule.text() == text]
            if same:  # the same plan as a row already measured: measured once, shown twice
                alias[config] = same[0]
                peaks[config] = peaks[same[0]]
                counted[config] = counted[same[0]]
                return
            add(config, net, list(net.module.parameters()))
            measure(config)
            known.setdefault(text, (net.schedule, heap, peaks[config], _stages_run(net)))

        for fraction in args.fractions:
            add_edgetrain(f"edgetrain@{fraction:g}", int(fraction * peaks["plain"]))
        # The least budget that allows storing everything (the store-all plan's predicted
        # peak, loss included): the plan then runs the model as it is.
        everything = simulate(edgetrain.planning, store_all(edgetrain.planning)).peak_bytes
        add_edgetrain("edgetrain@store-all", everything)
        # Matched rows: the fastest plan whose *measured* heap peak is within compile@b's.
        for budget in args.budgets:
            target = compile_peaks.get(f"compile@{budget:g}")
            if target is not None:
                config = f"edgetrain≤compile@{budget:g}"
                try:
                    found = _fit(edgetrain, target, lambda n: _measured_peak(n, x, args), known)
                except EdgetrainError as exc:
                    notes[config] = str(exc)
                    continue
                add_net(config, *found)
                if peaks[config] > target:
                    over = (peaks[config] - target) / MiB
                    notes[config] = f"no plan measured within: this one is {over:.1f} MiB over"

    _progress(f"{name}: timing {len(configs)} configurations, {args.rounds} rounds")
    samples = interleaved_samples(configs, rounds=args.rounds, warmup=0)
    for config, source in alias.items():
        samples[config] = samples[source]

    def median_of(config: str) -> tuple[float | None, float | None]:
        return sample_medians(samples[config]) if config in samples else (None, None)

    def ratio(config: str, reference: str) -> tuple[float | None, float | None]:
        if config not in samples or reference not in samples:
            return None, None
        return paired_ratio(samples, config, reference)

    rows = []
    for config in [*configs, *alias, *reused, *(c for c in notes if c not in nets)]:
        row: dict[str, Any] = {"model": label, "config": config}
        if config in reused:
            row.update(reused[config])
            row["model"] = label
            row["mem/plain"] = row["peak_MiB"] * MiB / peaks["plain"]
            row["note"] = f"compile row from {args.compile_json}"
            rows.append(row)
            continue
        cpu, wall = median_of(config)
        per_plain = ratio(config, "plain")
        per_compile = ratio(config, "compile@1") if config in compiled else (None, None)
        net = nets.get(config)
        row.update(
            {
                "peak_MiB": peaks[config] / MiB if config in peaks else None,
                "counter_MiB": counted[config] / MiB if config in counted else None,
                "mem/plain": peaks[config] / peaks["plain"] if config in peaks else None,
                "cpu_s": cpu,
                "wall_s": wall,
                "cpu/plain": per_plain[0],
                "wall/plain": per_plain[1],
                "cpu/compile@1": per_compile[0],
                "wall/compile@1": per_compile[1],
                "compile_s": compile_s.get(config),
                "planned_MiB": planned[config] / MiB if config in planned else None,
                "plan": _describe(net, edgetrain) if net is not None else None,
                "note": notes.get(config)
                or (f"same plan as {alias[config]}" if config in alias else None),
            }
        )
        rows.append(row)
    return rows, _verdicts(label, rows, args.budgets)


def _measured_peak(net: Any, x: torch.Tensor, args: argparse.Namespace) -> int:
    """Heap peak of a training step of ``net`` (after a warm-up), as the rows measure it."""
    step = _training_step(net, list(net.module.parameters()), x)
    step()
    return max(malloc_peak(step) for _ in range(args.mem_repeats))


def _fit(
    edgetrain: Edgetrain,
    target: int,
    peak_of: Callable[[Any], int],
    known: dict[str, tuple[Schedule, int, int, int]],
    probes: int = 10,
) -> tuple[Any, int]:
    """The fastest plan whose measured heap peak is within ``target`` bytes: (its
    ``Checkpointed``, the heap budget it was planned for); or, when none is found, the plan
    with the least measured peak.

    A plan fits when both its predicted peak (tensors, loss included: exact) and its measured
    heap peak (``peak_of``, as the rows measure it) are within ``target``. The heap also holds
    what kernels allocate without making a tensor, which no plan predicts: on MobileNetV2 the
    backward of the depthwise stride-2 convolution on 8 x 96 x 64 x 64 holds 13-27 MiB beyond
    its 12 MiB input gradient, so a plan whose peak falls there measures over while a plan for
    a smaller budget may fit (the planner is not monotone in the budget either). So the
    planner's budget is searched by measuring: the target first; when that plan measures over,
    the target less what it showed over, and the least plan's budget if that does not fit
    either; then bisection between the highest budget whose plan fits and the lowest above it
    whose plan does not, or, while none fits, the middle of the widest interval between budgets
    tried; at most ``probes`` budgets, down to 0.25 MiB apart. ``known`` (plan
    text -> (plan, heap budget, measured peak, stages the executor runs)): plans measured
    before, candidates too; the plans measured here are added to it. Each plan runs with
    ``target`` as the budget it was made for, so that the executor may run its stages as one
    graph up to it (:meth:`Edgetrain.checkpointed`); the fastest plan is the one whose predicted
    time plus :data:`~edgetrain.runtime.prepared.STAGE_SECONDS` per stage the executor runs is
    least.
    """
    least = edgetrain.least_bytes()
    fits: dict[int, bool] = {}  # budget tried -> whether its plan fits
    runs: dict[str, str] = {}  # plan text -> how the executor ran it (for the log)

    def fitting(schedule: Schedule, peak: int) -> bool:
        return peak <= target and edgetrain.predicted(schedule).peak_bytes <= target

    def probe(budget: int) -> int:
        """Measure the plan for ``budget``; returns how far its peak is over ``target``."""
        schedule = edgetrain.plan(budget)
        text = schedule.text()
        if text not in known:
            # Only the plan is kept: a model copy per probe grew the heap, and glibc's
            # mallinfo2, which the sampler calls, walks it holding the allocator's lock,
            # slowing every later step (probes 4 s apart at first, 85 s by the seventh).
            net = edgetrain.checkpointed(schedule, target)
            known[text] = (schedule, budget, peak_of(net), _stages_run(net))
            runs[text] = net.runs_as
            del net
            gc.collect()
            release_free_memory()
        schedule, _, peak, _ = known[text]
        fits[budget] = fitting(schedule, peak)
        predicted = edgetrain.predicted(schedule).peak_bytes
        _progress(
            f"  within {target / MiB:.1f} MiB? planned for {budget / MiB:.2f}: predicted "
            f"{predicted / MiB:.2f}, measured {peak / MiB:.2f} ({runs.get(text, 'known')})"
        )
        return max(peak, predicted) - target

    over = probe(max(target, least))
    if target > least and over > 0:
        probe(max(least, target - over))  # less by what the heap showed over
        if not any(fits.values()) and least not in fits:
            probe(least)
        while len(fits) < probes:
            budgets = sorted(fits)
            good = [b for b in budgets if fits[b]]
            if good:
                low = max(good)
                above = [b for b in budgets if b > low]
                if not above:
                    break
                high = min(above)
            else:
                low, high = max(itertools.pairwise(budgets), key=lambda pair: pair[1] - pair[0])
            if high - low < MiB // 4:
                break
            probe((low + high) // 2)
    candidates = [v for v in known.values() if fitting(v[0], v[2])]
    if candidates:
        # The plan's compute, and the executor's own cost per stage it runs (one graph: one).
        schedule, heap, _, _ = min(
            candidates, key=lambda v: edgetrain.predicted(v[0]).seconds + STAGE_SECONDS * v[3]
        )
    else:
        schedule, heap, _, _ = min(known.values(), key=lambda v: v[2])
    return edgetrain.checkpointed(schedule, target), heap


def _stages_run(net: Any) -> int:
    """How many stages the executor runs a plan as: one for a store-all plan, which runs the
    model as it is (counted as all of its stages, a plan recomputing 2 % would pass for faster
    than storing everything)."""
    return 1 if net._stores_everything else net._exec_length


def _describe(net: Any, edgetrain: Edgetrain | None) -> str:
    """The plan in a few words: store-all, or the whole step's predicted recompute factor and
    peak (loss included), and how it runs (one graph, or how many stages the executor runs)."""
    if net._stores_everything:
        return "store-all"
    cost = edgetrain.predicted(net.schedule) if edgetrain is not None else net.cost
    return f"rho {cost.recompute_factor:.2f}, pred {cost.peak_bytes / MiB:.1f}, {net.runs_as}"


def _verdicts(label: str, rows: list[dict[str, Any]], budgets: list[float]) -> list[dict[str, Any]]:
    """Per compile budget: is edgetrain's matched row at or below compile's measured peak, at no
    more CPU-time overhead (edgetrain / plain against compile@b / compile@1)? And the store-all
    check: edgetrain planned for the store-all plan's peak within 1.03 × plain's CPU time."""
    by = {row["config"]: row for row in rows}
    out = []
    for budget in budgets:
        comp, mine = by.get(f"compile@{budget:g}"), by.get(f"edgetrain≤compile@{budget:g}")
        if comp is None or mine is None:
            continue
        fits = mine.get("peak_MiB") is not None
        ours, theirs = mine.get("cpu/plain"), comp.get("cpu/compile@1")
        out.append(
            {
                "model": label,
                "target": f"vs compile@{budget:g}",
                "compile_MiB": comp["peak_MiB"],
                "edgetrain_MiB": mine.get("peak_MiB"),
                "peak<=compile": fits and mine["peak_MiB"] <= comp["peak_MiB"],
                "compile overhead": theirs,
                "edgetrain overhead": ours,
                "overhead<=compile's": fits and None not in (ours, theirs) and ours <= theirs,
                "note": mine.get("note"),
            }
        )
    store = by.get("edgetrain@store-all")
    if store is not None and store.get("cpu/plain") is not None:
        out.append(
            {
                "model": label,
                "target": "store-all <= 1.03 x plain",
                "edgetrain_MiB": store["peak_MiB"],
                "edgetrain overhead": store["cpu/plain"],
                "peak<=compile": None,
                "overhead<=compile's": store["plan"] == "store-all" and store["cpu/plain"] <= 1.03,
                "note": f"planned for {store['planned_MiB']:.1f} MiB: {store['plan']}",
            }
        )
    return out


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _parse_models(text: str | None) -> dict[str, tuple[int, int]]:
    if not text:
        return dict(DEFAULT_MODELS)
    models = {}
    for item in text.split(","):
        name, *rest = item.strip().split(":")
        key = canonical_name(name)
        batch, size = (int(rest[0]), int(rest[1])) if rest else DEFAULT_MODELS.get(key, (4, 128))
        models[key] = (batch, size)
    return models


TIME_METHOD = (
    "paired: median over rounds of a row's step over the reference's in the same round "
    "(rounds shuffled); cpu = process CPU time (judged), wall beside"
)
"""The ``time`` field of ``--json`` output; a run without it divided two medians."""


def _reused_compile_rows(path: str | None) -> dict[str, dict[str, dict[str, Any]]]:
    """Compile rows of an earlier ``--json`` run, by model label and config. Rows of a run
    timed another way (ratios of medians, no ``time`` field) are taken, with a warning."""
    if path is None:
        return {}
    try:
        run = json.loads(Path(path).read_text())
        rows = run["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(
            f"--compile-json {path}: not the --json output of this script ({exc})"
        ) from exc
    if run.get("time") != TIME_METHOD:
        _progress(
            f"warning: --compile-json {path} was timed another way ({run.get('time')!r}); "
            "its compile overheads are not paired ratios"
        )
    keep = ("peak_MiB", "cpu_s", "wall_s", "cpu/plain", "wall/plain", "cpu/compile@1")
    keep += ("wall/compile@1", "compile_s")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if str(row.get("config", "")).startswith("compile@") and row.get("peak_MiB") is not None:
            out.setdefault(row["model"], {})[row["config"]] = {k: row.get(k) for k in keep}
    return out


COLUMNS = [
    "model", "config", "peak_MiB", "counter_MiB", "mem/plain", "cpu/plain", "wall/plain",
    "cpu/compile@1", "compile_s", "plan", "note",
]  # fmt: skip
VERDICT_COLUMNS = [
    "model", "target", "compile_MiB", "edgetrain_MiB", "peak<=compile", "compile overhead",
    "edgetrain overhead", "overhead<=compile's", "note",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", help="name[:batch:size],...  (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (median reported)")
    parser.add_argument("--mem-repeats", type=int, default=7, help="memory runs (max reported)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument(
        "--budgets",
        default=",".join(f"{b:g}" for b in COMPILE_BUDGETS),
        help="torch.compile activation_memory_budget values",
    )
    parser.add_argument(
        "--compile-json",
        metavar="FILE",
        help="reuse the compile rows (peaks, step ratios, compile s) of an earlier --json run",
    )
    parser.add_argument("--no-edgetrain", dest="edgetrain", action="store_false")
    parser.add_argument(
        "--fractions",
        default=",".join(f"{f:g}" for f in EDGETRAIN_BUDGETS),
        help="edgetrain rows at these fractions of plain's peak",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.budgets = [float(b) for b in args.budgets.split(",")]
    args.fractions = [float(f) for f in args.fractions.split(",") if f]
    reused = _reused_compile_rows(args.compile_json)
    torch.set_num_threads(args.threads)
    torch._inductor.config.compile_threads = 1  # no compile workers beside the other jobs
    torch._inductor.config.cpp.threads = args.threads  # compiled kernels: as many as eager
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    rows: list[dict[str, Any]] = []
    verdicts: list[dict[str, Any]] = []
    for name, (batch, size) in _parse_models(args.models).items():
        label = f"{name} b{batch} {size}"
        model_rows, model_verdicts = bench_model(name, batch, size, args, reused.get(label, {}))
        rows += model_rows
        verdicts += model_verdicts
    extra = {
        "memory": "glibc mallinfo2 (uordblks + hblkhd) sampled in a thread, peak above start",
        "time": TIME_METHOD,
        "setting": f"torch {torch.__version__}, {args.threads} threads, "
        f"{args.rounds} interleaved rounds",
    }
    if args.json:
        emit("Training step of models with a forward()", COLUMNS, rows, True,
             extra={**extra, "verdicts": verdicts})  # fmt: skip
        return
    emit("Training step of models with a forward(): peak memory and time", COLUMNS, rows, False)
    emit("Against torch.compile's budgets", VERDICT_COLUMNS, verdicts, False, extra=extra)


if __name__ == "__main__":
    main()
