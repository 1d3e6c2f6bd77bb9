"""One HiGHS run of a :class:`~edgetrain.planners.poet.model.MilpModel`: options, the model in one
call, an optional MIP start, progress while it runs, and what it found and proved."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from edgetrain.planners.poet.model import MilpModel

Progress = Callable[[float, float | None, float | None], None]
"""Called while solving with (elapsed seconds, best energy J or None, lower bound J or None)."""


def run(
    model: MilpModel,
    time_limit: float,
    rel_gap: float,
    threads: int,
    progress: Progress | None,
    obj_scale: float,
    start: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[Any, Any, np.ndarray | None, float, float | None, float]:
    """Solve; returns (model status, highspy, solution or None, objective, dual bound, seconds)."""
    import highspy

    h = highspy.Highs()  # type: ignore[no-untyped-call]
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(rel_gap))
    h.setOptionValue("mip_abs_gap", 1e-9)
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("mip_feasibility_tolerance", 1e-9)
    h.setOptionValue("primal_feasibility_tolerance", 1e-9)
    h.passModel(_lp(model, highspy))
    if start is not None:
        # A partial start (the integer columns of a known plan): HiGHS completes the rest.
        h.setSolution(len(start[0]), start[0].astype(np.int32), start[1].astype(np.float64))
    if progress is not None:
        last = [0.0]

        def report(_kind: Any, _message: str, data: Any, _input: Any, _user: Any) -> None:
            out = data
            now = time.perf_counter() - began
            if now - last[0] < 0.5:
                return
            last[0] = now
            primal = out.mip_primal_bound
            dual = out.mip_dual_bound
            progress(now, _scaled(primal, obj_scale), _scaled(dual, obj_scale))

        h.setCallback(report, None)
        h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
    began = time.perf_counter()
    h.run()
    seconds = time.perf_counter() - began
    status = h.getModelStatus()
    info = h.getInfo()
    solution = None
    if info.primal_solution_status == 2:  # feasible
        solution = np.array(h.getSolution().col_value)
    dual_bound = _scaled(float(info.mip_dual_bound), obj_scale)
    return status, highspy, solution, float(info.objective_function_value), dual_bound, seconds


def _lp(model: MilpModel, highspy: Any) -> Any:
    """The model as a ``highspy.HighsLp`` (row-wise matrix)."""
    lp = highspy.HighsLp()
    lp.num_col_ = model.num_cols
    lp.num_row_ = model.num_rows
    lp.col_cost_ = np.array(model.cost, dtype=np.float64)
    lp.col_lower_ = np.array(model.lower, dtype=np.float64)
    lp.col_upper_ = np.array(model.upper, dtype=np.float64)
    lp.row_lower_ = np.array(model.row_lower, dtype=np.float64)
    lp.row_upper_ = np.array(model.row_upper, dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(model.starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(model.index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(model.value, dtype=np.float64)
    lp.a_matrix_.num_col_ = model.num_cols
    lp.a_matrix_.num_row_ = model.num_rows
    lp.integrality_ = [
        highspy.HighsVarType.kInteger if flag else highspy.HighsVarType.kContinuous
        for flag in model.integer
    ]
    return lp


def _scaled(bound: float, obj_scale: float) -> float | None:
    """An objective bound in joules; None when HiGHS has none (infinite or ±1e30 and beyond)."""
    return bound / obj_scale if math.isfinite(bound) and abs(bound) < 1e30 else None


def status_text(status: Any) -> str:
    """HiGHS's words for a model status."""
    import highspy

    return str(highspy.Highs().modelStatusToString(status))  # type: ignore[no-untyped-call]
