"""Planners: pure functions from a chain and a budget to a Schedule (no torch).

:func:`plan` is the entry point: give a strategy and either a memory budget (bytes of activations
above weights, gradients and input, as :func:`edgetrain.core.simulator.simulate` counts them) or a
recompute factor; it returns the fastest plan within the memory, or the smallest-memory plan
within the recompute factor.
"""

from __future__ import annotations

from edgetrain.planners.search import FRONTIER_STRATEGIES, STRATEGIES, plan, plan_for_device

__all__ = ["FRONTIER_STRATEGIES", "STRATEGIES", "plan", "plan_for_device"]
