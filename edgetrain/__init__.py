"""edgetrain: train neural networks on memory-limited edge devices.

The planning core (chains, schedules, planners, the simulator) imports no torch, so plans can be
made on a machine without it; the torch side (profiling, the executor) loads on first use::

    import edgetrain
    net = edgetrain.Checkpointed(model, sample, memory_budget="512MB")   # torch
    schedule = edgetrain.plan(chain, "optimal", max_recompute=1.5)       # pure
    points = edgetrain.frontier(chain)      # pure; edgetrain.frontier(model, x) profiles
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from edgetrain.core.chain import Chain, Stage
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import Cost, simulate
from edgetrain.errors import (
    CorruptFile,
    EdgetrainError,
    InfeasibleBudget,
    InvalidInput,
    InvalidSchedule,
)
from edgetrain.planners import plan
from edgetrain.runtime.frontier import FrontierPoint, frontier, knee

__version__ = "0.1.0"

# The torch side of the public API, imported on first use: name -> (module, attribute).
_TORCH_SIDE = {
    "Checkpointed": ("edgetrain.runtime.checkpointed", "Checkpointed"),
    "profile_chain": ("edgetrain.frontend.profiling", "profile_chain"),
    "analytic_chain": ("edgetrain.frontend.profiling", "analytic_chain"),
    "StorageCounter": ("edgetrain.autograd.storage_counter", "StorageCounter"),
}

# Names of the previous release, kept for one release: name -> (module, attribute, new name).
_DEPRECATED = {
    "profile": ("edgetrain.frontend.profiling", "profile_chain", "edgetrain.profile_chain"),
    "model_chain": ("edgetrain.models", "model_chain", "edgetrain.models.model_chain"),
    "build_model": ("edgetrain.models", "build", "edgetrain.models.build"),
    "capture": ("edgetrain.frontend.fx_capture", "capture", "edgetrain.frontend.fx_capture"),
    "STRATEGIES": ("edgetrain.planners", "STRATEGIES", "edgetrain.planners.STRATEGIES"),
    "uniform_chain": ("edgetrain.core.chain", "uniform_chain", "edgetrain.core.chain"),
}

__all__ = [
    "Chain",
    "Checkpointed",
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
    "StorageCounter",
    "analytic_chain",
    "frontier",
    "knee",
    "plan",
    "profile_chain",
    "simulate",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_SIDE:
        module, attribute = _TORCH_SIDE[name]
        return getattr(importlib.import_module(module), attribute)
    if name in _DEPRECATED:
        module, attribute, new = _DEPRECATED[name]
        warnings.warn(
            f"edgetrain.{name} is deprecated and goes in the next release; use {new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'edgetrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_TORCH_SIDE])
