"""Shared steps of the planning commands: fixed memory, and the budget left for activations."""

from __future__ import annotations

from dataclasses import dataclass

from edgetrain.chain import Chain
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.memory import optimizer_state_bytes
from edgetrain.planners import plan
from edgetrain.schedule import Schedule
from edgetrain.units import format_bytes


@dataclass(frozen=True)
class Fixed:
    """What a training step holds whatever the plan (bytes)."""

    weights: int
    gradients: int
    optimizer: int
    buffers: int
    input: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.buffers + self.input


def fixed_bytes(chain: Chain, optimizer: str) -> Fixed:
    """The plan-independent memory of a step on ``chain`` with ``optimizer``."""
    return Fixed(
        chain.weight_bytes,
        chain.gradient_bytes,
        optimizer_state_bytes(chain, optimizer),
        chain.buffer_bytes,
        chain.input_bytes,
    )


def plan_for_device(
    chain: Chain,
    strategy: str,
    fixed: Fixed,
    memory: int | None,
    recompute: float | None,
) -> Schedule:
    """Plan with ``memory`` meaning the whole device memory for training (not only activations).

    An infeasible budget is reported in the user's terms: the smallest *device* memory that works.
    """
    if memory is not None and recompute is not None:
        raise InvalidInput("give --memory or --recompute, not both")
    budget = None
    if memory is not None:
        budget = memory - fixed.total
        if budget <= 0:
            raise InfeasibleBudget(
                f"{format_bytes(memory)} does not hold the weights, gradients, optimizer state "
                f"and input ({format_bytes(fixed.total)}); give more memory",
                fixed.total,
            )
    try:
        return plan(chain, strategy, memory=budget, recompute=recompute)
    except InfeasibleBudget as exc:
        if memory is None or exc.smallest is None:
            raise
        smallest = fixed.total + exc.smallest
        raise InfeasibleBudget(
            f"{strategy} cannot train in {format_bytes(memory)}; the smallest memory that works "
            f"is {format_bytes(smallest)} ({int(smallest)} bytes)",
            smallest,
        ) from exc
