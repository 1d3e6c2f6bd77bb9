"""The planning core, pure Python: what a training step is (a :class:`Chain` of stages), what a
plan is (a :class:`Schedule` of operations) and what it costs (:func:`simulate`), and what a
step holds whatever the plan (:func:`fixed_training_bytes`)."""

from __future__ import annotations

from edgetrain.core.accounting import OPTIMIZER_STATES, fixed_training_bytes
from edgetrain.core.chain import Chain, Stage
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import Cost, simulate

__all__ = [
    "OPTIMIZER_STATES",
    "Chain",
    "Cost",
    "Op",
    "Schedule",
    "Stage",
    "fixed_training_bytes",
    "simulate",
]
