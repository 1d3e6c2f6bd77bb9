"""What a training step holds whatever the plan: weights, gradients, optimizer state, buffers
and the input. Pure: numbers in (a :class:`~edgetrain.core.chain.Chain`), numbers out."""

from __future__ import annotations

from edgetrain.core.chain import Chain
from edgetrain.errors import InvalidInput

OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}
"""Buffers an optimizer keeps per parameter: SGD none, SGD with momentum one, Adam two."""


def optimizer_state_bytes(chain: Chain, optimizer: str) -> int:
    """Optimizer state for ``chain``'s trainable parameters (bytes)."""
    if optimizer not in OPTIMIZER_STATES:
        raise InvalidInput(
            f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZER_STATES)}"
        )
    return OPTIMIZER_STATES[optimizer] * chain.gradient_bytes


def fixed_training_bytes(chain: Chain, optimizer: str = "sgd") -> int:
    """What a training step holds whatever the plan: weights, gradients, optimizer state,
    buffers and the input (bytes)."""
    return (
        chain.weight_bytes
        + chain.gradient_bytes
        + optimizer_state_bytes(chain, optimizer)
        + chain.buffer_bytes
        + chain.input_bytes
    )
