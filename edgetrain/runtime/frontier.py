"""The memory/time frontier of a model or chain in one call, and the budgets read off it.

:func:`frontier` returns the Pareto points (budget bytes, recompute factor, predicted seconds) of
a strategy's plans, from the smallest budget that plans to storing everything; each point's
budget, given back as a budget, plans that point (or a faster one). :func:`knee` picks the point
``memory_budget="auto"`` uses. Pure for a chain; a model is profiled (torch) on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edgetrain.core.chain import Chain
from edgetrain.errors import InvalidInput
from edgetrain.planners.optimal import DEFAULT_SLOTS
from edgetrain.planners.search import frontier as plan_frontier


@dataclass(frozen=True)
class FrontierPoint:
    """One plan of the frontier.

    Attributes:
        budget_bytes: the budget it plans in: ``fixed_bytes`` + its activation peak (for a
            model, what ``Checkpointed(memory_budget=...)`` takes; for a chain with no fixed
            part, what ``plan(memory=...)`` takes).
        activation_bytes: its simulated peak above what the step starts with, the kernels'
            scratch included (``Cost.heap_peak_bytes``).
        recompute_factor: its time over plain autograd's.
        seconds: its predicted time (the chain's stage times).
    """

    budget_bytes: int
    activation_bytes: int
    recompute_factor: float
    seconds: float


def frontier(
    model_or_chain: Any,
    x: Any = None,
    *,
    strategy: str = "optimal",
    grads_exist: bool | None = None,
    fixed_bytes: int | None = None,
    slots: int = DEFAULT_SLOTS,
) -> list[FrontierPoint]:
    """The Pareto frontier of ``strategy``'s plans, by budget ascending (and so by recompute
    factor descending), from the smallest feasible budget to storing everything.

    ``model_or_chain``: a :class:`~edgetrain.core.chain.Chain` (planned as it is: budgets of
    activations, ``fixed_bytes`` 0 and the loop ``grads_exist`` False unless given) or a model
    with a sample input ``x`` (profiled as :class:`~edgetrain.runtime.checkpointed.Checkpointed`
    profiles it:
    budgets of the whole step, its :attr:`~edgetrain.runtime.checkpointed.Checkpointed.fixed_bytes`
    and
    loop unless given).
    """
    if isinstance(model_or_chain, Chain):
        chain = model_or_chain
        exist = bool(grads_exist)
        fixed = 0 if fixed_bytes is None else int(fixed_bytes)
    else:
        if x is None:
            raise InvalidInput("frontier(model, x) needs a sample input x for a model")
        # The torch side, loaded on first use (the pure core imports no torch).
        checkpointed = importlib.import_module("edgetrain.runtime.checkpointed").Checkpointed
        net = checkpointed(model_or_chain, x)
        chain = net.chain
        exist = net.grads_exist if grads_exist is None else grads_exist
        fixed = net.fixed_bytes if fixed_bytes is None else int(fixed_bytes)
        if grads_exist is not None and fixed_bytes is None:
            fixed += chain.gradient_bytes * (int(grads_exist) - int(net.grads_exist))
    found = plan_frontier(chain, strategy, grads_exist=exist, slots=slots)
    return [
        FrontierPoint(fixed + p.peak_bytes, p.peak_bytes, p.recompute_factor, p.seconds)
        for p in found.points
    ]


def knee(points: Sequence[FrontierPoint]) -> FrontierPoint:
    """The knee of a frontier: with memory and time each scaled to [0, 1] between the smallest
    budget's point and storing everything's, the point farthest below the straight line between
    those two (the most time saved for the memory spent); the smallest budget's point when none
    is below that line (two points, or a straight frontier)."""
    if not points:
        raise InvalidInput("an empty frontier has no knee")
    first, last = points[0], points[-1]
    memory_span = max(last.budget_bytes - first.budget_bytes, 1)
    time_span = max(first.seconds - last.seconds, 1e-300)
    best, below = first, 0.0
    for point in points:
        memory = (point.budget_bytes - first.budget_bytes) / memory_span
        time = (point.seconds - last.seconds) / time_span
        gap = (1.0 - memory) - time  # the line runs from (0, 1) to (1, 0)
        if gap > below + 1e-12:
            best, below = point, gap
    return best
