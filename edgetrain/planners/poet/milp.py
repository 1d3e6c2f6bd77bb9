"""POET's MILP on HiGHS: the least-energy plan of recomputation and paging under RAM and time.

Patil et al., "POET: Training Neural Networks on Tiny Devices with Integrated Rematerialization and
Paging", ICML 2022 (github.com/ShishirPatil/poet). For a
:class:`~edgetrain.planners.poet.graph.TrainingGraph` of
``T`` nodes, stage ``t`` computes node ``t`` and may recompute any earlier node; binaries per stage
and node say what is computed (``R``), held in RAM or on flash entering the stage (``S_ram``,
``S_flash``) and paged in or out during it (``page_in``, ``page_out``). The objective is energy
(compute + page-in + page-out, joules); RAM and runtime are budgets. The constraints are written
out in :mod:`edgetrain.planners.poet.check`, which checks every plan returned here independently.

Two accountings (see :mod:`edgetrain.planners.poet.check`): ``poet`` is POET's problem exactly as
its code states it (to compare with POET); ``edgetrain`` (the default) counts paging time in the
runtime and counts memory as the executor holds it. Three modes: ``hybrid`` (both), ``remat``
(no paging), ``paging`` (no recomputation).

What is not POET's, to make HiGHS prove more, faster (the optimum is POET's: each change keeps
every plan POET allows or an equally cheap one, and every plan it admits is one POET allows):

* ``Free`` is continuous and disaggregated: ``Free ≤ R[t][k]``, ``Free ≤ 1 − S_ram[t+1][i]``,
  ``Free ≤ 1 − R[t][j]`` for each later successor ``j``. That is all it needs: a smaller ``Free``
  only overstates memory, so the solver takes POET's 0/1 value whenever it matters, and a plan's
  true levels (re-derived by the checker) are never above the model's. Only a parallel edge, which
  POET frees twice and which could drive a level below 0, also gets
  ``Free ≥ R[t][k] − S_ram[t+1][i] − ΣR[t][j]``. Parallel edges share one ``Free`` with a doubled
  coefficient. Tighter than POET's aggregated big-M pair, and about a quarter fewer rows.
* With paging (:mod:`~edgetrain.planners.poet.formulation`): flash keeps what was paged out and a
  node is paged out at most once (``S_flash[t+1] = S_flash[t] + page_out[t]``; keeping a value on
  flash is free, a second page-out only costs), and a value in RAM entering ``t'`` was in RAM at an
  earlier stage, recomputed since, or is on flash. Without these the LP relaxation pages a value
  back in by slivers at the price of a page-in alone; with them the root bound of POET's ResNet-18
  at 50 % of its peak rises from 0.053 % to 0.109 % above the every-node-once energy (the best plan
  known is 0.111 % above it).
* ``hybrid`` starts HiGHS from the best plan of the same MILP restricted to plausible plans
  (:func:`~edgetrain.planners.poet.warmstart.neighbourhood`: recompute a value only within 3 edges
  of a stage's node, page in just before a read, page out soon after the value is made), a few
  percent of the variables, given up to 30 % of the time limit (``remat`` and ``paging`` too on
  graphs of 60 nodes or more). On POET's instances it finds the best plan known in seconds, so the
  full model's time goes into the lower bound. A plan of the caller's (``initial_plan``) can start
  it as well.
* Variables that must be 0 (``i > t``, ``S`` and paging for ``i ≥ t``, ``U[t][k]`` for ``k > t+1``)
  are never created; fixed modes set bounds instead of adding rows.
* The objective is scaled so the every-node-once energy (a proven lower bound) is 10⁶; gaps are
  tight (relative 10⁻⁷ by default), since HiGHS's default 10⁻⁴ stops at non-optimal plans here.
* When the keep-everything plan fits both budgets it is optimal (its energy is the lower bound)
  and is returned without a solve.

The answer says what it is: ``optimal``, ``feasible`` (time limit hit, with the gap and the lower
bound), ``infeasible`` (proven; then the smallest RAM budget that meets the runtime budget is found
by a second MILP minimising the budget, when it can be proven within the time limit) or
``no_solution`` (nothing found within the limit, nothing proven).
The solver is split by concept: :mod:`~edgetrain.planners.poet.formulation` writes the MILP (one
constraint family per function; :mod:`~edgetrain.planners.poet.runnable` the rows of runnable
plans) into a :class:`~edgetrain.planners.poet.model.MilpModel`,
:mod:`~edgetrain.planners.poet.warmstart` finds starts, :mod:`~edgetrain.planners.poet.highs` runs
HiGHS, and :func:`solve` here drives them and says what the answer is.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from edgetrain.errors import InvalidInput
from edgetrain.planners.poet.check import (
    ACCOUNTINGS,
    MATRICES,
    Accounting,
    Evaluation,
    evaluate,
    store_all,
    violations,
)
from edgetrain.planners.poet.formulation import MODES, OBJECTIVE_SCALE, Mode, build
from edgetrain.planners.poet.graph import TrainingGraph
from edgetrain.planners.poet.highs import Progress, run, status_text
from edgetrain.planners.poet.model import plan_from, start_from
from edgetrain.planners.poet.warmstart import restricted, usable

__all__ = [
    "MODES",
    "OBJECTIVE_SCALE",
    "TIME_MARGIN",
    "WARM_MIN_NODES",
    "WARM_SHARE",
    "MilpResult",
    "Mode",
    "Progress",
    "Status",
    "solve",
]

Status = Literal["optimal", "feasible", "infeasible", "no_solution"]

WARM_SHARE = 0.3
"""Share of the time limit the restricted search for a start (``hybrid`` mode) may use."""
TIME_MARGIN = 0.05
"""Share of the time limit kept back for HiGHS overrunning its own limit."""
WARM_MIN_NODES = 60
"""``remat`` and ``paging`` start from a restricted search only on graphs this large (smaller ones
HiGHS solves in a second or two alone); ``hybrid`` always does."""


@dataclass(frozen=True)
class MilpResult:
    """What the solver found, and what it proved.

    Attributes:
        status: ``optimal``, ``feasible``, ``infeasible`` or ``no_solution``.
        accounting / mode: the problem solved.
        ram_budget_bytes: the RAM budget (bytes; None = none).
        runtime_budget_seconds: the runtime budget (seconds; None = none).
        energy_joules: the plan's energy (J), recomputed from its matrices; None without a plan.
        lower_bound_joules: proven lower bound on the optimum (J); None when nothing is proven.
        gap: ``(energy − lower bound) / energy``; 0 when optimal; None without a plan.
        solve_seconds: wall time of the solve(s) (s).
        evaluation: the plan's peak RAM, runtime and energy split (see
            :class:`~edgetrain.planners.poet.check.Evaluation`); None without a plan.
        plan: the five 0/1 matrices (``T × T`` int arrays) keyed by name; None without a plan.
        smallest_ram_bytes: when infeasible, the least RAM budget meeting the runtime budget, if
            proven (None otherwise).
        message: one line on how the answer was reached.
        variables / constraints: size of the MILP (0 when none was built).
    """

    status: Status
    accounting: Accounting
    mode: Mode
    ram_budget_bytes: float | None
    runtime_budget_seconds: float | None
    energy_joules: float | None
    lower_bound_joules: float | None
    gap: float | None
    solve_seconds: float
    evaluation: Evaluation | None = None
    plan: dict[str, np.ndarray] | None = field(default=None, compare=False)
    smallest_ram_bytes: float | None = None
    message: str = ""
    variables: int = 0
    constraints: int = 0

    def matrices(self) -> dict[str, list[list[int]]] | None:
        """Per matrix, for each stage ``t`` the node ids whose variable is 1 (JSON-ready)."""
        if self.plan is None:
            return None
        return {key: [np.flatnonzero(row).tolist() for row in self.plan[key]] for key in MATRICES}


@dataclass(frozen=True)
class _Problem:
    """One call of :func:`solve`: the graph, its budgets (runtime in seconds) and how to solve."""

    graph: TrainingGraph
    ram_bytes: float | None
    runtime: float | None
    mode: Mode
    accounting: Accounting
    runnable: bool
    time_limit: float
    threads: int
    began: float

    def common(self) -> dict[str, Any]:
        """The fields every :class:`MilpResult` of this problem shares."""
        return {
            "accounting": self.accounting,
            "mode": self.mode,
            "ram_budget_bytes": self.ram_bytes,
            "runtime_budget_seconds": self.runtime,
        }

    def elapsed(self) -> float:
        """Seconds since the solve began."""
        return time.perf_counter() - self.began


def solve(
    graph: TrainingGraph,
    *,
    ram_bytes: float | None = None,
    runtime_factor: float | None = None,
    mode: Mode = "hybrid",
    accounting: Accounting = "edgetrain",
    time_limit: float = 60.0,
    rel_gap: float = 1e-7,
    threads: int = 1,
    progress: Progress | None = None,
    find_smallest_ram: bool = True,
    warm_start: bool = True,
    initial_plan: dict[str, np.ndarray] | None = None,
    runnable: bool = False,
) -> MilpResult:
    """The least-energy plan for ``graph`` within ``ram_bytes`` of RAM and a runtime of
    ``runtime_factor`` times the every-node-once compute time (POET's multiplier).

    ``initial_plan`` (the five ``T × T`` 0/1 matrices, e.g. a chain planner's plan) starts HiGHS
    when it passes :func:`~edgetrain.planners.poet.check.violations`, fits both budgets and the
    mode; the restricted search's plan (``warm_start``) replaces it when that is cheaper.

    ``runnable`` restricts the plans to those the chain executor runs exactly (see
    :mod:`edgetrain.planners.poet.runnable`; :mod:`edgetrain.planners.poet.to_schedule` turns
    them into schedules).

    Raises :class:`InvalidInput` for a bad mode, accounting or budget; an infeasible budget is a
    result (``status == "infeasible"``), not an error.
    """
    _check_arguments(mode, accounting, ram_bytes, runtime_factor, time_limit)
    runtime = None if runtime_factor is None else runtime_factor * graph.compute_seconds
    problem = _Problem(
        graph=graph,
        ram_bytes=ram_bytes,
        runtime=runtime,
        mode=mode,
        accounting=accounting,
        runnable=runnable,
        time_limit=time_limit,
        threads=threads,
        began=time.perf_counter(),
    )
    answer = _without_a_solve(problem)
    if answer is not None:
        return answer
    if progress is not None:
        progress(problem.elapsed(), None, None)  # solving starts: say so at once
    start_plan, warm = _start(problem, initial_plan, warm_start, progress)
    model, variables, obj_scale, _ = build(
        graph, ram_bytes, runtime, mode, accounting, runnable=runnable
    )
    start = None if start_plan is None else start_from(start_plan, variables)
    # HiGHS can overrun its limit by a few seconds on a loaded machine: keep a margin.
    left = max((1 - TIME_MARGIN) * time_limit - problem.elapsed(), 0.5)
    status, highspy, values, _objective, dual, seconds = run(
        model, left, rel_gap, threads, progress, obj_scale, start
    )
    size: dict[str, Any] = {"variables": model.num_cols, "constraints": model.num_rows}
    ms = highspy.HighsModelStatus
    if values is not None and status not in (ms.kInfeasible,):
        plan = plan_from(values, variables)
        optimal = status == ms.kOptimal
        text = f"HiGHS: {status_text(status)} in {seconds:.2f} s{warm}"
        return _with_plan(problem, plan, optimal, dual, text, size)
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        # Every variable is bounded and costs are >= 0: "unbounded or infeasible" is infeasible.
        return _infeasible(problem, find_smallest_ram, seconds, size)
    return _no_solution(problem, dual, f"HiGHS: {status_text(status)} after {seconds:.2f} s", size)


def _check_arguments(
    mode: Mode,
    accounting: Accounting,
    ram_bytes: float | None,
    runtime_factor: float | None,
    time_limit: float,
) -> None:
    """Raise :class:`InvalidInput` for a bad mode, accounting, budget or time limit."""
    if mode not in MODES:
        raise InvalidInput(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if accounting not in ACCOUNTINGS:
        raise InvalidInput(f"unknown accounting {accounting!r}; choose poet or edgetrain")
    if ram_bytes is not None and not ram_bytes > 0:
        raise InvalidInput(f"RAM budget must be positive bytes, got {ram_bytes}")
    if runtime_factor is not None and not runtime_factor > 0:
        raise InvalidInput(f"runtime factor must be positive (e.g. 1.5), got {runtime_factor}")
    if not time_limit > 0:
        raise InvalidInput(f"time limit must be positive seconds, got {time_limit}")


def _without_a_solve(problem: _Problem) -> MilpResult | None:
    """The answer when no MILP is needed: keep-everything fits both budgets (it reaches the
    lower bound, so it is optimal), or the runtime budget is below one computation of every
    node (infeasible); None otherwise."""
    graph, ram_bytes, runtime = problem.graph, problem.ram_bytes, problem.runtime
    everything = store_all(graph)
    cost = evaluate(graph, everything, problem.accounting)
    fits_ram = ram_bytes is None or cost.peak_ram_bytes <= ram_bytes
    fits_time = runtime is None or cost.runtime_seconds <= runtime * (1 + 1e-12)
    if fits_ram and fits_time:
        return MilpResult(
            status="optimal",
            energy_joules=cost.energy_joules,
            lower_bound_joules=graph.compute_joules,
            gap=0.0,
            solve_seconds=problem.elapsed(),
            evaluation=cost,
            plan=everything,
            message="keep-everything fits: its energy is the every-node-once lower bound",
            **problem.common(),
        )
    if runtime is not None and graph.compute_seconds > runtime * (1 + 1e-12):
        return MilpResult(
            status="infeasible",
            energy_joules=None,
            lower_bound_joules=None,
            gap=None,
            solve_seconds=problem.elapsed(),
            message="the runtime budget is below one computation of every node",
            **problem.common(),
        )
    return None


def _start(
    problem: _Problem,
    initial_plan: dict[str, np.ndarray] | None,
    warm_start: bool,
    progress: Progress | None,
) -> tuple[dict[str, np.ndarray] | None, str]:
    """The plan HiGHS starts from (None: none) and how the message says so: the caller's plan
    when :func:`~edgetrain.planners.poet.warmstart.usable`, replaced by the restricted search's
    when that is cheaper."""
    p = problem
    start_plan: dict[str, np.ndarray] | None = None
    warm = ""
    given = math.inf
    if initial_plan is not None:
        given = usable(
            p.graph, initial_plan, p.ram_bytes, p.runtime, p.mode, p.accounting, p.runnable
        )
        if math.isfinite(given):
            start_plan = {key: np.asarray(initial_plan[key]) for key in MATRICES}
            warm = f"; started from the given plan ({given:.6g} J)"
    if warm_start and (p.mode == "hybrid" or len(p.graph) >= WARM_MIN_NODES):
        # The same MILP over a neighbourhood of plausible plans (a few percent of the variables,
        # see warmstart.neighbourhood) finds a plan at or near the optimum in seconds; HiGHS
        # starts the full model from it, so its own time goes into the lower bound.
        found, energy = restricted(
            p.graph,
            p.ram_bytes,
            p.runtime,
            p.mode,
            p.accounting,
            WARM_SHARE * p.time_limit,
            p.threads,
            progress,
            p.began,
            p.runnable,
        )
        if found is not None and energy < given:
            start_plan = found
            warm = (
                f"; started from a restricted search's plan ({energy:.6g} J, found in "
                f"{p.elapsed():.1f} s)"
            )
    return start_plan, warm


def _with_plan(
    problem: _Problem,
    plan: dict[str, np.ndarray],
    optimal: bool,
    dual: float | None,
    message: str,
    size: dict[str, Any],
) -> MilpResult:
    """The answer with a plan (checked independently): ``optimal`` or ``feasible``, with the
    proven bound (never above the plan's energy) and the gap."""
    graph, accounting = problem.graph, problem.accounting
    broken = violations(graph, plan, accounting, runnable=problem.runnable)
    if broken:
        raise AssertionError(f"the MILP returned an invalid plan: {broken[0]}")
    result = evaluate(graph, plan, accounting)
    energy = result.energy_joules
    bound = energy if optimal and dual is None else dual
    if bound is not None:
        bound = min(bound, energy)
    gap = 0.0 if energy == 0 else (energy - bound) / energy if bound is not None else None
    return MilpResult(
        status="optimal" if optimal else "feasible",
        energy_joules=energy,
        lower_bound_joules=bound,
        gap=gap,
        solve_seconds=problem.elapsed(),
        evaluation=result,
        plan=plan,
        message=message,
        **size,
        **problem.common(),
    )


def _infeasible(
    problem: _Problem, find_smallest_ram: bool, seconds: float, size: dict[str, Any]
) -> MilpResult:
    """The answer when HiGHS proves the budgets infeasible, with the smallest RAM budget that
    meets the runtime budget when asked and proven in the time left."""
    smallest = None
    note = ""
    if find_smallest_ram and problem.ram_bytes is not None:
        left = max((1 - TIME_MARGIN) * problem.time_limit - problem.elapsed(), 1.0)
        smallest, note = _smallest_ram(
            problem.graph,
            problem.runtime,
            problem.mode,
            problem.accounting,
            left,
            problem.threads,
            problem.runnable,
        )
    return MilpResult(
        status="infeasible",
        energy_joules=None,
        lower_bound_joules=None,
        gap=None,
        solve_seconds=problem.elapsed(),
        smallest_ram_bytes=smallest,
        message=f"HiGHS proved the budgets infeasible in {seconds:.2f} s{note}",
        **size,
        **problem.common(),
    )


def _no_solution(
    problem: _Problem, dual: float | None, message: str, size: dict[str, Any]
) -> MilpResult:
    """The answer when HiGHS stops without a plan and without proving infeasibility."""
    return MilpResult(
        status="no_solution",
        energy_joules=None,
        lower_bound_joules=dual,
        gap=None,
        solve_seconds=problem.elapsed(),
        message=f"{message} without a plan; raise --time-limit",
        **size,
        **problem.common(),
    )


def _smallest_ram(
    graph: TrainingGraph,
    runtime: float | None,
    mode: Mode,
    accounting: Accounting,
    time_limit: float,
    threads: int,
    runnable: bool = False,
) -> tuple[float | None, str]:
    """The least RAM budget that meets ``runtime`` (bytes), by a MILP minimising the budget."""
    model, variables, _, _ = build(
        graph, None, runtime, mode, accounting, minimise_ram=True, runnable=runnable
    )
    status, highspy, values, _objective, _dual, _seconds = run(
        model, time_limit, 1e-9, threads, None, 1.0
    )
    ms = highspy.HighsModelStatus
    if status == ms.kOptimal and values is not None:
        plan = plan_from(values, variables)
        peak = evaluate(graph, plan, accounting).peak_ram_bytes
        return peak, f"; the smallest RAM for this runtime is {peak:.0f} bytes"
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return None, "; no RAM budget meets this runtime budget"
    return None, "; the smallest feasible RAM was not proven within the time limit"
