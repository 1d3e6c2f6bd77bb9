"""When a step plans again: the plans kept for states a step may come back to, and what changed
between the state a plan was made for and a step's, in words."""

from __future__ import annotations

from typing import Any

KEPT_PLANS = 16
"""Plans :class:`Checkpointed` keeps for states it may come back to (a value ``forward()`` reads
that changes every step plans every step; pass such a value as a tensor instead)."""


def autocast_mismatch(measured: tuple[str, ...], now: tuple[str, ...]) -> str:
    """Why a given chain cannot plan this step: it was measured in another autocast state."""

    def state(label: tuple[str, ...]) -> str:
        return f"under torch.autocast({', '.join(label)})" if label else "without torch.autocast"

    return (
        f"chain= was measured {state(measured)} but Checkpointed is built {state(now)}, where "
        "the step holds other dtypes and sizes; build it in the state the chain was measured "
        "in (a step in another autocast state then plans for that state), or pass no chain="
    )


def describe_change(planned: tuple[Any, ...], now: tuple[Any, ...], shapes: str) -> str:
    """What differs between two :meth:`Checkpointed._state` keys, in words (``shapes``: the
    input's then and now)."""
    changes = [
        what
        for what, a, b in zip(
            (
                f"an input of {shapes}",
                "another input needing a gradient",
                "other parameters needing gradients (frozen or unfrozen layers)",
                "another train/eval mode",
                "another torch.autocast state",
                "another value of a module attribute (fx traced the old one into the stages)",
                "a training loop that keeps gradients between steps"
                if now[-1]
                else "a training loop that sets gradients to None (zero_grad())",
            ),
            planned,
            now,
            strict=True,
        )
        if a != b
    ]
    return ", ".join(changes)
