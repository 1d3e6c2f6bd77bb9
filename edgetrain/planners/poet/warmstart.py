"""Starts for the full MILP: a caller's plan when it is usable, and the best plan of the same MILP
restricted to plausible plans (:func:`neighbourhood`), found in a share of the time limit."""

from __future__ import annotations

import math
import time

import numpy as np

from edgetrain.planners.poet.check import Accounting, evaluate, violations
from edgetrain.planners.poet.formulation import Mode, build
from edgetrain.planners.poet.graph import TrainingGraph
from edgetrain.planners.poet.highs import Progress, run
from edgetrain.planners.poet.model import plan_from

WARM_REL_GAP = 1e-5
"""The restricted search stops within this relative gap of its own optimum."""


def usable(
    graph: TrainingGraph,
    plan: dict[str, np.ndarray],
    ram: float | None,
    runtime: float | None,
    mode: Mode,
    accounting: Accounting,
    runnable: bool = False,
) -> float:
    """The energy (J) of ``plan`` when it is a valid start for this problem, else infinity."""
    try:
        if violations(graph, plan, accounting, runnable=runnable):
            return math.inf
        cost = evaluate(graph, plan, accounting)
    except (KeyError, ValueError):
        return math.inf
    if ram is not None and cost.peak_ram_bytes > ram * (1 + 1e-9):
        return math.inf
    if runtime is not None and cost.runtime_seconds > runtime * (1 + 1e-12):
        return math.inf
    if mode == "remat" and (cost.paged_in or cost.paged_out):
        return math.inf
    if mode == "paging" and cost.recomputed:
        return math.inf
    return cost.energy_joules


def restricted(
    graph: TrainingGraph,
    ram: float | None,
    runtime: float | None,
    mode: Mode,
    accounting: Accounting,
    time_limit: float,
    threads: int,
    progress: Progress | None,
    began: float,
    runnable: bool = False,
) -> tuple[dict[str, np.ndarray] | None, float]:
    """The best plan of the MILP restricted to :func:`neighbourhood` within ``time_limit``
    (a valid plan of the full problem, checked), and its energy (J); (None, nan) without one."""
    model, variables, obj_scale, _ = build(
        graph,
        ram,
        runtime,
        mode,
        accounting,
        allowed=neighbourhood(graph),
        strengthen=False,
        runnable=runnable,
    )
    report = None
    if progress is not None:
        outer = progress

        def report(_elapsed: float, best: float | None, _bound: float | None) -> None:
            # The restricted bound is not a bound of the full problem: report the plan only.
            outer(time.perf_counter() - began, best, None)

    _status, _highspy, values, _objective, _dual, _seconds = run(
        model, max(time_limit, 0.5), WARM_REL_GAP, threads, report, obj_scale
    )
    if values is None:
        return None, math.nan
    plan = plan_from(values, variables)
    if violations(graph, plan, accounting, runnable=runnable):
        return None, math.nan
    cost = evaluate(graph, plan, accounting)
    if ram is not None and cost.peak_ram_bytes > ram * (1 + 1e-9):
        return None, math.nan
    return plan, cost.energy_joules


def neighbourhood(
    graph: TrainingGraph, depth: int = 3, page_in_window: int = 2, page_out_window: int = 3
) -> dict[str, np.ndarray]:
    """Which ``R``, ``page_in`` and ``page_out`` variables a restricted search keeps (boolean
    ``T × T`` masks): plans that recompute a value only in a stage that needs it, page a value in
    just before it is read and page it out soon after it is made.

    * ``R[t][i]``: ``i`` is an ancestor of node ``t`` at most ``depth`` edges up (or ``i == t``);
    * ``page_in[t][i]``: ``i`` is read by a node in ``t+1 .. t+page_in_window``, or is within
      ``depth`` edges of one (a page-in during ``t`` is usable from ``t + 1`` on);
    * ``page_out[t][i]``: ``t <= i + page_out_window``.

    A small fraction of the variables; on POET's ResNet-18 its optimum is the best plan known, and
    HiGHS finds it in seconds where the full model needs minutes (see
    :func:`edgetrain.planners.poet.milp.solve`).
    """
    t_count = len(graph)
    near: list[set[int]] = []
    for t in range(t_count):
        seen: set[int] = set()
        front = {t}
        for _ in range(depth):
            front = {u for x in front for u in graph.predecessors(x)} - seen
            seen |= front
        near.append(seen)
    rows = np.arange(t_count)[:, None]
    cols = np.arange(t_count)[None, :]
    r = np.zeros((t_count, t_count), dtype=bool)
    page_in = np.zeros((t_count, t_count), dtype=bool)
    for t in range(t_count):
        r[t, t] = True
        r[t, sorted(near[t])] = True
        for j in range(t + 1, min(t + 1 + page_in_window, t_count)):
            page_in[t, sorted(i for i in near[j] if i < t)] = True
    page_out = (rows > cols) & (rows <= cols + page_out_window)
    return {"R": r, "page_in": page_in & (rows > cols), "page_out": page_out}
