"""A short training run on synthetic data with a checkpointing plan, measuring what it holds.

Used by ``edgetrain train`` and ``edgetrain demo``; also a worked example of the library API.
Synthetic data: random images and labels from a fixed seed (nothing can be downloaded here).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edgetrain.execute import Checkpointed
from edgetrain.measure import StorageCounter, storage_bytes
from edgetrain.memory import OPTIMIZER_STATES


@dataclass(frozen=True)
class TrainReport:
    """What a run measured.

    Attributes:
        steps: optimizer steps taken.
        predicted_peak_bytes: the plan's peak plus weights, gradients, buffers, input and
            optimizer state.
        plain_peak_bytes: the same for plain autograd (everything stored).
        measured_peak_bytes: the same, measured: the storages held before a step plus the most the
            step held above them (a step after the first, so gradients and optimizer state exist).
        step_seconds: median wall time of a step (measurement steps excluded).
        recompute_factor: the plan's predicted factor.
        first_loss, last_loss: cross-entropy at the first and the last step.
    """

    steps: int
    predicted_peak_bytes: int
    plain_peak_bytes: int
    measured_peak_bytes: int
    step_seconds: float
    recompute_factor: float
    first_loss: float
    last_loss: float


def make_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """SGD, SGD with momentum 0.9, or Adam."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9 if name == "momentum" else 0.0)


def held_before_step(
    params: list[nn.Parameter],
    module: nn.Module,
    opt: torch.optim.Optimizer,
    inputs: list[torch.Tensor],
) -> int:
    """Bytes a training step starts with: weights, gradients, buffers, optimizer state, inputs."""
    held: list[torch.Tensor] = [*params, *module.buffers(), *inputs]
    held += [p.grad for p in params if p.grad is not None]
    held += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return storage_bytes(held)


def train(
    net: Checkpointed,
    batch_shape: tuple[int, ...],
    classes: int,
    steps: int,
    *,
    optimizer: str = "momentum",
    lr: float = 0.01,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainReport:
    """Train ``net`` for ``steps`` steps on random data; measure memory on the second step."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_shape, generator=generator)
    labels = torch.randint(0, classes, (batch_shape[0],), generator=generator)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params, lr)
    loss_fn = nn.CrossEntropyLoss()
    state_bytes = OPTIMIZER_STATES[optimizer] * sum(p.numel() * p.element_size() for p in params)
    predicted = net.predicted_peak_bytes + state_bytes
    plain = net.plain_peak_bytes + state_bytes
    measured = 0
    times: list[float] = []
    losses: list[float] = []
    measure_at = min(2, steps)
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=False)
        start = time.perf_counter()
        if step == measure_at:
            before = held_before_step(params, net, opt, [images, labels])
            counter = StorageCounter()
            with counter:
                loss = loss_fn(net(images), labels)
                loss.backward()
            measured = before + counter.peak_bytes
            # The loop this step ran in (gradients kept) is the one the prediction is for.
            predicted = net.predicted_peak_bytes + state_bytes
            plain = net.plain_peak_bytes + state_bytes
        else:
            loss = loss_fn(net(images), labels)
            loss.backward()
        opt.step()
        if step != measure_at:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return TrainReport(
        steps=steps,
        predicted_peak_bytes=predicted,
        plain_peak_bytes=plain,
        measured_peak_bytes=measured,
        step_seconds=statistics.median(times) if times else float("nan"),
        recompute_factor=net.cost.recompute_factor,
        first_loss=losses[0],
        last_loss=losses[-1],
    )
