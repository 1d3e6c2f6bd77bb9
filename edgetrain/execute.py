"""Checkpointed: run a Schedule inside autograd, as an ``nn.Module``.

    net = edgetrain.Checkpointed(model, sample_input, memory_budget="512MB")
    loss = criterion(net(x), target)
    loss.backward()              # runs the plan's backward phase; gradients land in .grad

Contract (compare ``torch.utils.checkpoint``):

* The forward runs the plan's forward phase (every operation before its first backward); the
  output's backward runs the rest. Gradients equal plain autograd's on the same inputs.
* Every stage is run once in the forward phase, exactly as in plain autograd. A recomputation
  replays the random-number state the stage saw the first time (dropout masks are the same) and
  restores the stage's buffers afterwards, so BatchNorm running statistics and
  ``num_batches_tracked`` end exactly as without checkpointing.
* Memory: what the step holds above the weights, gradients and input is the plan's
  ``Cost.peak_bytes`` (for the sample input's shape), as counted by
  :class:`~edgetrain.measure.StorageCounter`. Gradients are assumed to exist before the step
  (``zero_grad(set_to_none=False)``, or any step after the first); if they are created during
  backward, each stage's also stays held once its backward has run.
* When grad is off (``torch.no_grad()``) or nothing needs a gradient, the model just runs.
* A step's backward can run once (no ``retain_graph``, no double backward).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from edgetrain.chain import Chain
from edgetrain.errors import InfeasibleBudget, InvalidInput, InvalidSchedule
from edgetrain.memory import fixed_training_bytes
from edgetrain.planners.optimal import store_all
from edgetrain.planners.search import plan_for_device
from edgetrain.profile import profile
from edgetrain.schedule import Cost, Op, Schedule, simulate
from edgetrain.stages import run_backward, run_forward, run_forward_with_grad
from edgetrain.units import format_bytes, parse_bytes

_RngState = tuple[torch.Tensor, list[torch.Tensor]]  # CPU generator state, CUDA states


class Checkpointed(nn.Module):
    """Train an ``nn.Sequential`` within a memory budget by running a checkpointing plan.

    Args:
        model: the ``nn.Sequential`` to train (its children are the stages).
        sample_input: an input of the shape training will use; profiled on this device.
        memory_budget: bytes (or "512MB") the step may use for weights, gradients, buffers,
            the input and activations together; the plan is the fastest that fits.
        max_recompute: alternatively, the largest recompute factor (time over plain autograd's,
            >= 1); the plan then uses the least memory that keeps to it.
        strategy: "optimal" (dynamic program), "revolve" or "sequential".
        reserve_bytes: memory to leave for other things (optimizer state ...) out of
            ``memory_budget``.
        chain: a chain to plan on instead of profiling ``model`` (e.g. an analytic one).
        schedule: a ready plan (e.g. ``Schedule.load(path)``) instead of planning.

    Attributes:
        chain: the profiled chain. schedule: the plan. cost: its simulated cost (peak bytes of
        activations above weights, gradients and input; seconds; recompute factor).
    """

    def __init__(
        self,
        model: nn.Module,
        sample_input: torch.Tensor,
        *,
        memory_budget: int | float | str | None = None,
        max_recompute: float | None = None,
        strategy: str = "optimal",
        reserve_bytes: int = 0,
        chain: Chain | None = None,
        schedule: Schedule | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Sequential):
            raise InvalidInput(
                f"Checkpointed needs an nn.Sequential, got {type(model).__name__}; "
                "wrap the model's blocks in nn.Sequential(...)"
            )
        self.model = model
        self.chain = chain if chain is not None else profile(model, sample_input)
        self.reserve_bytes = int(reserve_bytes)
        device = None if memory_budget is None else parse_bytes(memory_budget)
        if schedule is None:
            schedule = plan_for_device(
                self.chain,
                strategy,
                device_bytes=device,
                fixed_bytes=self.fixed_bytes + self.reserve_bytes,
                recompute=max_recompute,
            )
        self.schedule = schedule
        try:
            self.cost: Cost = simulate(self.chain, schedule)
        except InvalidSchedule as exc:
            raise InvalidSchedule(f"the plan does not fit this model: {exc}") from exc
        if device is not None:
            limit = device - self.reserve_bytes
            if self.predicted_peak_bytes > limit:
                raise InfeasibleBudget(
                    f"the given plan needs {format_bytes(self.predicted_peak_bytes)}, more than "
                    f"the budget {format_bytes(limit)}; re-plan for this budget",
                    self.predicted_peak_bytes,
                )
        self._stages = _stage_modules(model, self.chain)

    @property
    def fixed_bytes(self) -> int:
        """Weights, gradients, buffers and the input: what the step holds before it starts."""
        return fixed_training_bytes(self.chain)

    @property
    def plain_peak_bytes(self) -> int:
        """Predicted peak of the whole step under plain autograd (storing everything)."""
        return self.fixed_bytes + simulate(self.chain, store_all(self.chain)).peak_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """Predicted peak of the whole step: :attr:`fixed_bytes` + the plan's activation peak."""
        return self.fixed_bytes + self.cost.peak_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = tuple(p for p in self.model.parameters() if p.requires_grad)
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            return self.model(x)
        run = _Run(self.schedule, self._stages)
        out: torch.Tensor = _ScheduleFunction.apply(run, x, *params)
        return out

    def extra_repr(self) -> str:
        return (
            f"strategy={self.schedule.strategy!r}, stages={self.chain.length}, "
            f"peak_bytes={self.cost.peak_bytes}, recompute_factor={self.cost.recompute_factor:.3f}"
        )


def _stage_modules(model: nn.Sequential, chain: Chain) -> list[nn.Module]:
    children = list(model.children())
    if sum(stage.span for stage in chain.stages) != len(children):
        raise InvalidInput(
            f"the chain covers {sum(s.span for s in chain.stages)} children but the model has "
            f"{len(children)}; profile this model again"
        )
    modules: list[nn.Module] = []
    start = 0
    for stage in chain.stages:
        part = children[start : start + stage.span]
        modules.append(part[0] if stage.span == 1 else nn.Sequential(*part))
        start += stage.span
    return modules


@dataclass
class _Run:
    """The state of one training step: what the plan holds between operations."""

    schedule: Schedule
    stages: list[nn.Module]
    plain: dict[int, torch.Tensor] = field(default_factory=dict)
    graphs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    rng: dict[int, _RngState] = field(default_factory=dict)
    input_requires_grad: bool = False
    done: bool = False

    def value(self, k: int) -> torch.Tensor:
        if k in self.plain:
            return self.plain[k]
        return self.graphs[k - 1][1]

    def execute(self, ops: list[tuple[int, int]]) -> None:
        for code, k in ops:
            kind = Op(code)
            if kind is Op.DISCARD:
                del self.plain[k]
            elif kind is Op.BACKWARD:
                leaf, out = self.graphs.pop(k)
                grad = self.grads.pop(k + 1)
                grad_input = run_backward(leaf, out, grad)
                if grad_input is not None:  # None for an input that needs no gradient
                    self.grads[k] = grad_input
                del leaf, out, grad, grad_input
            else:
                self._forward(kind, k)

    def _forward(self, kind: Op, k: int) -> None:
        x = self.value(k)
        module = self.stages[k]
        with self._replay(k, module):
            if kind is Op.FORWARD_ALL:
                needs = k > 0 or self.input_requires_grad
                self.graphs[k] = run_forward_with_grad(module, x, needs_input_grad=needs, stage=k)
            else:
                self.plain[k + 1] = run_forward(module, x, stage=k)
        del x
        if kind is Op.FORWARD_NOSAVE and k > 0:
            self.plain.pop(k, None)

    def _replay(self, k: int, module: nn.Module) -> AbstractContextManager[None]:
        """First run of stage k: remember its RNG state. Later runs: replay it, keep buffers."""
        if k not in self.rng:
            self.rng[k] = _rng_state()
            return nullcontext()
        return _recomputing(self.rng[k], module)


@contextmanager
def _recomputing(state: _RngState, module: nn.Module) -> Iterator[None]:
    """Replay a stage's first RNG state, on copies of its buffers.

    The recomputation updates the copies (BatchNorm running statistics ...), which are then
    dropped: the module's own buffers are untouched, and a graph may keep the copies it saved.
    """
    outer = _rng_state()
    _set_rng_state(state)
    swapped: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor]] = []
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                swapped.append((sub._buffers, name, buffer))
                sub._buffers[name] = buffer.detach().clone()
    try:
        yield
    finally:
        for buffers, name, original in swapped:
            buffers[name] = original
        _set_rng_state(outer)


def _rng_state() -> _RngState:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def _set_rng_state(state: _RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


class _ScheduleFunction(torch.autograd.Function):
    """Forward: the plan's forward phase. Backward: the rest of the plan."""

    @staticmethod
    def forward(ctx: Any, run: _Run, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        schedule = run.schedule
        end = schedule.forward_phase_end
        ops = list(zip(schedule.kinds.tolist(), schedule.indices.tolist(), strict=True))
        run.input_requires_grad = x.requires_grad
        run.plain[0] = x
        run.execute(ops[:end])
        ctx.run = run
        ctx.backward_ops = ops[end:]
        ctx.num_params = len(params)
        return run.graphs[schedule.length - 1][1].detach()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        run: _Run = ctx.run
        if run.done:
            raise RuntimeError(
                "Checkpointed: backward through the same step twice; its saved state is freed "
                "after the first backward (retain_graph is not supported)"
            )
        run.grads[run.schedule.length] = grad_output
        del grad_output
        run.execute(ctx.backward_ops)
        grad_input = run.grads.pop(0, None)
        run.plain.clear()
        run.graphs.clear()
        run.grads.clear()
        run.done = True
        return (None, grad_input, *([None] * ctx.num_params))
