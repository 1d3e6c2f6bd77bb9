"""edgetrain: train neural networks on memory-limited edge devices.

The pure core (chains, schedules, planners, the memory model) imports no torch, so plans can be
made on a machine without it; the torch side (profiling, execution, models) loads on first use::

    import edgetrain
    net = edgetrain.Checkpointed(model, sample, memory_budget="512MB")   # torch
    schedule = edgetrain.plan(chain, "optimal", recompute=1.5)             # pure
    points = edgetrain.frontier(chain)      # pure; edgetrain.frontier(model, x) profiles
"""

from __future__ import annotations

import importlib
from typing import Any

from edgetrain.chain import Chain, Stage, uniform_chain
from edgetrain.errors import (
    CorruptFile,
    EdgetrainError,
    InfeasibleBudget,
    InvalidInput,
    InvalidSchedule,
)
from edgetrain.frontiers import FrontierPoint, frontier, knee
from edgetrain.planners import STRATEGIES, plan
from edgetrain.schedule import Cost, Op, Schedule, simulate

__version__ = "0.1.0"

_TORCH_SIDE = {
    "Checkpointed": "edgetrain.execute",
    "profile": "edgetrain.profile",
    "analytic_chain": "edgetrain.profile",
    "model_chain": "edgetrain.profile",
    "StorageCounter": "edgetrain.measure",
    "build_model": "edgetrain.models",
    "capture": "edgetrain.capture",
}

__all__ = [
    "STRATEGIES",
    "Chain",
    "CorruptFile",
    "Cost",
    "EdgetrainError",
    "FrontierPoint",
    "InfeasibleBudget",
    "InvalidInput",
    "InvalidSchedule",
    "Op",
    "Schedule",
    "Stage",
    "frontier",
    "knee",
    "plan",
    "simulate",
    "uniform_chain",
    *_TORCH_SIDE,
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_SIDE:
        module = importlib.import_module(_TORCH_SIDE[name])
        return getattr(module, "build" if name == "build_model" else name)
    raise AttributeError(f"module 'edgetrain' has no attribute {name!r}")
