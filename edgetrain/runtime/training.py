"""A short training run on synthetic data with a checkpointing plan, measuring what it holds.

Used by ``edgetrain train`` and ``edgetrain demo``; also a worked example of the library API.
Synthetic data (nothing can be downloaded here): the caller's input batch, and a target drawn
from a fixed seed once the model's first output shows its shape. The loss follows the output:
a ``(batch, classes)`` output (a classifier) gets cross-entropy against random class labels,
any other tensor (a segmentation map, a feature map, a language model's logits) the mean
squared error against a random standard normal target of its shape.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edgetrain.autograd.storage_counter import StorageCounter, storage_bytes
from edgetrain.core.accounting import OPTIMIZER_STATES
from edgetrain.errors import InvalidInput
from edgetrain.runtime.checkpointed import Checkpointed


@dataclass(frozen=True)
class TrainReport:
    """What a run measured.

    Attributes:
        steps: optimizer steps taken.
        loss: ``"cross-entropy"`` or ``"mean squared error"`` (see the module docstring).
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
    loss: str
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


class _Loss:
    """The synthetic loss for an output: chosen, with its random target, on the first output."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.target: torch.Tensor | None = None
        self.name = ""

    def __call__(self, out: object) -> torch.Tensor:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            what = type(out).__name__ if not isinstance(out, torch.Tensor) else str(out.dtype)
            raise InvalidInput(
                f"train needs a model that returns one floating-point tensor, got {what}; "
                "return the tensor a loss would be computed on"
            )
        if self.target is None:
            if out.dim() == 2:
                self.name = "cross-entropy"
                self.target = torch.randint(
                    0, out.shape[1], (out.shape[0],), generator=self.generator
                )
            else:
                self.name = "mean squared error"
                self.target = torch.randn(out.shape, generator=self.generator, dtype=out.dtype)
        if self.name == "cross-entropy":
            return nn.functional.cross_entropy(out, self.target)
        return nn.functional.mse_loss(out, self.target)


def train(
    net: Checkpointed,
    inputs: torch.Tensor,
    steps: int,
    *,
    optimizer: str = "momentum",
    lr: float = 0.01,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainReport:
    """Train ``net`` for ``steps`` steps on ``inputs`` and a random target (see the module
    docstring); measure memory on the second step."""
    params = [p for p in net.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params, lr)
    loss_fn = _Loss(seed)
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
            held = [inputs] if loss_fn.target is None else [inputs, loss_fn.target]
            before = held_before_step(params, net, opt, held)
            counter = StorageCounter()
            with counter:
                loss = loss_fn(net(inputs))
                loss.backward()
            measured = before + counter.peak_bytes
            # The loop this step ran in (gradients kept) is the one the prediction is for.
            predicted = net.predicted_peak_bytes + state_bytes
            plain = net.plain_peak_bytes + state_bytes
        else:
            loss = loss_fn(net(inputs))
            loss.backward()
        opt.step()
        if step != measure_at:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return TrainReport(
        steps=steps,
        loss=loss_fn.name,
        predicted_peak_bytes=predicted,
        plain_peak_bytes=plain,
        measured_peak_bytes=measured,
        step_seconds=statistics.median(times) if times else float("nan"),
        recompute_factor=net.cost.recompute_factor,
        first_loss=losses[0],
        last_loss=losses[-1],
    )
