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
* With paging (:func:`_reacquire`): flash keeps what was paged out and a node is paged out at most
  once (``S_flash[t+1] = S_flash[t] + page_out[t]``; keeping a value on flash is free, a second
  page-out only costs), and a value in RAM entering ``t'`` was in RAM at an earlier stage,
  recomputed since, or is on flash. Without these the LP relaxation pages a value back in by
  slivers at the price of a page-in alone; with them the root bound of POET's ResNet-18 at 50 %
  of its peak rises from 0.053 % to 0.109 % above the every-node-once energy (the best plan known
  is 0.111 % above it).
* ``hybrid`` starts HiGHS from the best plan of the same MILP restricted to plausible plans
  (:func:`_neighbourhood`: recompute a value only within 3 edges of a stage's node, page in just
  before a read, page out soon after the value is made), a few percent of the variables, given up
  to 30 % of the time limit (``remat`` and ``paging`` too on graphs of 60 nodes or more). On
  POET's instances it finds the best plan known in seconds, so the full model's time goes into
  the lower bound. A plan of the caller's (``initial_plan``) can start it as well.
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
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
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
from edgetrain.planners.poet.graph import TrainingGraph

Mode = Literal["hybrid", "remat", "paging"]
MODES: tuple[Mode, ...] = ("hybrid", "remat", "paging")
Status = Literal["optimal", "feasible", "infeasible", "no_solution"]
OBJECTIVE_SCALE = 1e6
"""The every-node-once energy (a lower bound) is scaled to this many objective units."""

WARM_SHARE = 0.3
"""Share of the time limit the restricted search for a start (``hybrid`` mode) may use."""
TIME_MARGIN = 0.05
"""Share of the time limit kept back for HiGHS overrunning its own limit."""
WARM_MIN_NODES = 60
"""``remat`` and ``paging`` start from a restricted search only on graphs this large (smaller ones
HiGHS solves in a second or two alone); ``hybrid`` always does."""
WARM_REL_GAP = 1e-5
"""The restricted search stops within this relative gap of its own optimum."""

Progress = Callable[[float, float | None, float | None], None]
"""Called while solving with (elapsed seconds, best energy J or None, lower bound J or None)."""


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


# -- the model -------------------------------------------------------------------------------------


class _Model:
    """Columns and rows collected as arrays, then passed to HiGHS in one call."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.starts: list[int] = [0]
        self.index: list[int] = []
        self.value: list[float] = []

    def col(self, lower: float, upper: float, *, integer: bool, cost: float = 0.0) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.cost.append(cost)
        self.integer.append(1 if integer else 0)
        return len(self.lower) - 1

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        merged: dict[int, float] = {}
        for col, coef in terms:
            if col >= 0:
                merged[col] = merged.get(col, 0.0) + coef
        for col, coef in merged.items():
            if coef != 0.0:
                self.index.append(col)
                self.value.append(coef)
        self.starts.append(len(self.index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    @property
    def num_cols(self) -> int:
        return len(self.lower)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)


@dataclass
class _Vars:
    r: np.ndarray
    s_ram: np.ndarray
    s_flash: np.ndarray
    page_in: np.ndarray
    page_out: np.ndarray
    budget: int  # column of the RAM budget when it is a variable, else -1


def _build(
    graph: TrainingGraph,
    ram: float | None,
    runtime: float | None,
    mode: Mode,
    accounting: Accounting,
    *,
    minimise_ram: bool = False,
    allowed: dict[str, np.ndarray] | None = None,
    strengthen: bool = True,
    pin_free: bool = False,
    runnable: bool = False,
) -> tuple[_Model, _Vars, float, float]:
    """The MILP; returns (model, variables, objective scale, memory scale).

    ``allowed`` (boolean ``T × T`` masks for ``R``, ``page_in`` and ``page_out``, see
    :func:`_neighbourhood`) restricts the search: a variable outside its mask is never created,
    i.e. fixed at 0. The restricted MILP is a heuristic for a start, never the answer.
    ``strengthen`` adds the valid inequalities of :func:`_reacquire`; ``pin_free`` writes
    ``Free``'s lower side for every edge (the formulation before; same optimum, more rows).
    """
    inf = math.inf
    t_count = len(graph)
    nodes = graph.nodes
    size = np.array([n.output_bytes for n in nodes])
    work = np.array([n.workspace_bytes for n in nodes])
    mem_scale = max(float(size.max()), 1.0) / 100.0  # memory rows in units of 1 % of the largest
    lower = graph.compute_joules
    obj_scale = OBJECTIVE_SCALE / lower if lower > 0 else OBJECTIVE_SCALE
    paging = mode != "remat"
    remat = mode != "paging"
    model = _Model()
    none = np.full((t_count, t_count), -1, dtype=np.int64)
    r, s_ram, s_flash, p_in, p_out = (none.copy() for _ in range(5))

    def may(key: str, t: int, i: int) -> bool:
        return allowed is None or bool(allowed[key][t, i])

    for t in range(t_count):
        for i in range(t + 1):
            if i < t and not may("R", t, i):
                continue
            fixed = 1.0 if i == t else None
            upper = 1.0 if (remat or i == t) else 0.0
            r[t, i] = model.col(
                fixed or 0.0,
                fixed or upper,
                integer=True,
                cost=0.0 if minimise_ram else nodes[i].compute_joules * obj_scale,
            )
        for i in range(t):
            s_ram[t, i] = model.col(0.0, 1.0, integer=True)
            if paging:
                s_flash[t, i] = model.col(0.0, 1.0 if i < t - 1 else 0.0, integer=True)
                if may("page_in", t, i):
                    p_in[t, i] = model.col(
                        0.0,
                        1.0,
                        integer=True,
                        cost=0.0 if minimise_ram else nodes[i].pagein_joules * obj_scale,
                    )
                if may("page_out", t, i):
                    p_out[t, i] = model.col(
                        0.0,
                        1.0,
                        integer=True,
                        cost=0.0 if minimise_ram else nodes[i].pageout_joules * obj_scale,
                    )
    budget_col = -1
    if minimise_ram:
        budget_col = model.col(0.0, inf, integer=False, cost=1.0)
    ram_limit = inf if (ram is None or minimise_ram) else ram / mem_scale

    # A value is computed from inputs in RAM.
    for u, v in graph.unique_edges:
        for t in range(v, t_count):
            model.row([(r[t, v], 1.0), (r[t, u], -1.0), (s_ram[t, u], -1.0)], -inf, 0.0)
    # What is in RAM or on flash entering t+1 was there, computed or paged during t.
    for t in range(t_count - 1):
        for i in range(t + 1):
            model.row(
                [(s_ram[t + 1, i], 1.0), (s_ram[t, i], -1.0), (r[t, i], -1.0), (p_in[t, i], -1.0)],
                -inf,
                0.0,
            )
            if paging:
                # Strengthened: flash keeps what was paged out, and a node is paged out at most
                # once (keeping a value on flash is free, a second page-out only costs): some
                # optimal plan has S_flash[t+1] = S_flash[t] + page_out[t], non-decreasing.
                model.row(
                    [(s_flash[t + 1, i], 1.0), (s_flash[t, i], -1.0), (p_out[t, i], -1.0)],
                    0.0 if strengthen else -inf,
                    0.0,
                )
    if paging and strengthen:
        _reacquire(model, graph, r, s_ram, s_flash)
    if accounting == "edgetrain" and not runnable:
        # A held value keeps what autograd saved with it.
        for v, u in graph.retains:
            for t in range(max(u, v) + 1, t_count):
                model.row([(s_ram[t, v], 1.0), (s_ram[t, u], -1.0)], -inf, 0.0)
    if paging:
        for t in range(t_count):
            for i in range(t):
                if p_in[t, i] >= 0:
                    model.row([(p_in[t, i], 1.0), (s_flash[t, i], -1.0)], -inf, 0.0)
                if p_out[t, i] >= 0:
                    model.row([(p_out[t, i], 1.0), (s_ram[t, i], -1.0)], -inf, 0.0)

    if runnable:
        _runnable_rows(model, graph, r, s_ram, p_in, p_out, retains=accounting == "edgetrain")

    # Free[t](i, k), one per distinct edge, weighted by its multiplicity under POET's accounting.
    multiplicity: dict[tuple[int, int], int] = {}
    for e in graph.edges:
        multiplicity[e] = multiplicity.get(e, 0) + 1 if accounting == "poet" else 1
    into: list[list[tuple[int, int, int]]] = [[] for _ in range(t_count)]  # k -> (i, mult, idx)
    for e_idx, ((i, k), mult) in enumerate(multiplicity.items()):
        into[k].append((i, mult, e_idx))
    free: dict[tuple[int, int], int] = {}
    for t in range(t_count):
        for k in range(t + 1):
            if r[t, k] < 0:
                continue  # k does not run in t: nothing is freed after it
            for i, mult, e_idx in into[k]:
                f = model.col(0.0, 1.0, integer=False)
                free[t, e_idx] = f
                later = [j for j in graph.successors(i) if k < j <= t and r[t, j] >= 0]
                keep = s_ram[t + 1, i] if t + 1 < t_count else -1
                model.row([(f, 1.0), (r[t, k], -1.0)], -inf, 0.0)
                if keep >= 0:
                    model.row([(f, 1.0), (keep, 1.0)], -inf, 1.0)
                for j in later:
                    model.row([(f, 1.0), (r[t, j], 1.0)], -inf, 1.0)
                if mult > 1 or pin_free:
                    # A value freed once is freed after being counted, so the level never goes
                    # below 0 and Free only needs its upper bounds (a smaller Free overstates
                    # memory, never understates it). A parallel edge frees twice (POET's
                    # accounting) and could push a level below 0: there Free is pinned.
                    model.row(
                        [(f, 1.0), (r[t, k], -1.0), (keep, 1.0)] + [(r[t, j], 1.0) for j in later],
                        0.0,
                        inf,
                    )

    def frees(t: int, k: int) -> list[tuple[int, float]]:
        return [
            (free[t, e_idx], mult * size[i] / mem_scale)
            for i, mult, e_idx in into[k]
            if (t, e_idx) in free
        ]

    # Memory.
    for t in range(t_count):
        base: list[tuple[int, float]] = [(s_ram[t, i], size[i] / mem_scale) for i in range(t)]
        held = 0.0
        if accounting == "edgetrain":
            base += [(p_in[t, i], size[i] / mem_scale) for i in range(t)]
            held = sum(size for stage, size in graph.held if stage <= t) / mem_scale
        cap = ram_limit - held if accounting == "edgetrain" else ram_limit
        if accounting == "poet":
            # U[t][0..min(t+1, T-1)]; later levels equal U[t][t+1].
            levels = [model.col(0.0, ram_limit, integer=False) for _ in range(min(t + 2, t_count))]
            model.row(
                [(levels[0], 1.0), (r[t, 0], -size[0] / mem_scale)] + [(c, -w) for c, w in base],
                0.0,
                0.0,
            )
            for k in range(1, len(levels)):
                terms = [(levels[k], 1.0), (levels[k - 1], -1.0)]
                if k <= t:
                    terms.append((r[t, k], -size[k] / mem_scale))
                terms += frees(t, k - 1)
                model.row(terms, 0.0, 0.0)
            if budget_col >= 0:
                for level in levels:
                    model.row([(level, 1.0), (budget_col, -1.0)], -inf, 0.0)
        else:
            # after[t][k] for k = 0..t; the level while k runs is after[t][k-1] + R[t][k]·m_k.
            after = [model.col(0.0, inf, integer=False) for _ in range(t + 1)]
            previous: list[tuple[int, float]] = [(c, w) for c, w in base]
            for k in range(t + 1):
                during = [*previous, (r[t, k], (size[k] + work[k]) / mem_scale)]
                if budget_col >= 0:
                    model.row([*during, (budget_col, -1.0)], -inf, -held)
                else:
                    model.row(during, -inf, cap)
                model.row([(after[k], 1.0)] + [(c, -w) for c, w in during] + frees(t, k), 0.0, 0.0)
                previous = [(after[k], 1.0)]

    # Runtime.
    if runtime is not None:
        scale = runtime if runtime > 0 else 1.0
        terms = [
            (r[t, i], nodes[i].compute_seconds / scale)
            for t in range(t_count)
            for i in range(t + 1)
        ]
        if accounting == "edgetrain" and paging:
            for t in range(t_count):
                for i in range(t):
                    terms.append((p_in[t, i], nodes[i].pagein_seconds / scale))
                    terms.append((p_out[t, i], nodes[i].pageout_seconds / scale))
        model.row(terms, -inf, runtime / scale * (1 + 1e-12))
    return model, _Vars(r, s_ram, s_flash, p_in, p_out, budget_col), obj_scale, mem_scale


def _reacquire(
    model: _Model, graph: TrainingGraph, r: np.ndarray, s_ram: np.ndarray, s_flash: np.ndarray
) -> None:
    """Valid inequalities that stop the LP relaxation from paging a value back in by slivers.

    Alone, ``S_ram[t+1] ≤ S_ram[t] + R[t] + page_in[t]`` and ``page_in[t] ≤ S_flash[t]`` let the
    relaxation page out 3 % of a value once and page in 3 % at each of 30 stages, so that it is
    back in RAM at the cost of a page-in alone (POET's ResNet-18: the root bound then sees a
    fraction of the paging energy). Keeping a value on flash costs nothing, so some optimal plan
    has ``S_flash`` non-decreasing (:func:`_build` asks it); then a value in RAM
    entering ``t'`` was in RAM entering some earlier ``t``, or computed in between, or is on flash
    entering ``t' − 1``:

        S_ram[t'][i] ≤ min_{t < t'} (S_ram[t][i] + Σ_{t ≤ s < t'} R[s][i]) + S_flash[t'−1][i]

    The minimum is a continuous ``W[t'][i]`` with ``W[t'] ≤ W[t'−1] + R[t'−1]`` and ``W[t'] ≤
    S_ram[t'−1] + R[t'−1]``. Written for ``i + 2 ≤ t' ≤`` the last reader of ``i`` (only there
    can a value be dropped and needed again), at most ``T²/2`` columns and ``3 T²/2`` rows.
    """
    inf = math.inf
    for i in range(len(graph)):
        previous = -1  # W[i+1][i] would be 1 (node i runs in stage i): no row needed
        last = max(graph.successors(i), default=i)
        for t in range(i + 2, last + 1):
            w = model.col(0.0, 1.0, integer=False)
            if previous >= 0:
                model.row([(w, 1.0), (previous, -1.0), (r[t - 1, i], -1.0)], -inf, 0.0)
            model.row([(w, 1.0), (s_ram[t - 1, i], -1.0), (r[t - 1, i], -1.0)], -inf, 0.0)
            model.row([(s_ram[t, i], 1.0), (w, -1.0), (s_flash[t - 1, i], -1.0)], -inf, 0.0)
            previous = w


def _neighbourhood(
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
    HiGHS finds it in seconds where the full model needs minutes (see :func:`solve`).
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


def _run(
    model: _Model,
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
    h.passModel(lp)
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
            progress(
                now,
                primal / obj_scale if math.isfinite(primal) and abs(primal) < 1e30 else None,
                dual / obj_scale if math.isfinite(dual) and abs(dual) < 1e30 else None,
            )

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
    dual = float(info.mip_dual_bound)
    dual_bound = dual / obj_scale if math.isfinite(dual) and abs(dual) < 1e30 else None
    return status, highspy, solution, float(info.objective_function_value), dual_bound, seconds


def _start_from(plan: dict[str, np.ndarray], v: _Vars) -> tuple[np.ndarray, np.ndarray]:
    """The integer columns of ``plan`` as (column indices, values) for a MIP start."""
    cols: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for key, index in (
        ("R", v.r),
        ("S_ram", v.s_ram),
        ("S_flash", v.s_flash),
        ("page_in", v.page_in),
        ("page_out", v.page_out),
    ):
        mask = index >= 0
        matrix = np.asarray(plan[key])
        if key == "page_out":
            # The model pages a node out at most once (a second page-out only costs energy) ...
            first = np.cumsum(matrix, axis=0)
            matrix = np.where((matrix > 0) & (first == 1), 1, 0)
        if key == "S_flash":
            # ... and keeps it on flash from then on (free): S_flash[t+1] = S_flash[t] + out[t].
            out = np.cumsum(np.asarray(plan["page_out"]), axis=0) > 0
            matrix = np.zeros_like(matrix)
            matrix[1:] = out[:-1]
        cols.append(index[mask])
        values.append(matrix[mask].astype(np.float64))
    return np.concatenate(cols), np.concatenate(values)


def _plan_from(values: np.ndarray, v: _Vars) -> dict[str, np.ndarray]:
    def matrix(cols: np.ndarray) -> np.ndarray:
        out = np.zeros(cols.shape, dtype=np.int64)
        mask = cols >= 0
        out[mask] = np.rint(values[cols[mask]]).astype(np.int64)
        return out

    return {
        "R": matrix(v.r),
        "S_ram": matrix(v.s_ram),
        "S_flash": matrix(v.s_flash),
        "page_in": matrix(v.page_in),
        "page_out": matrix(v.page_out),
    }


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
    :func:`_runnable_rows`; :mod:`edgetrain.planners.poet.to_schedule` turns them into schedules).

    Raises :class:`InvalidInput` for a bad mode, accounting or budget; an infeasible budget is a
    result (``status == "infeasible"``), not an error.
    """
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
    runtime = None if runtime_factor is None else runtime_factor * graph.compute_seconds
    common: dict[str, Any] = {
        "accounting": accounting,
        "mode": mode,
        "ram_budget_bytes": ram_bytes,
        "runtime_budget_seconds": runtime,
    }
    began = time.perf_counter()

    # The keep-everything plan reaches the lower bound: when it fits, it is optimal.
    everything = store_all(graph)
    cost = evaluate(graph, everything, accounting)
    fits_ram = ram_bytes is None or cost.peak_ram_bytes <= ram_bytes
    fits_time = runtime is None or cost.runtime_seconds <= runtime * (1 + 1e-12)
    if fits_ram and fits_time:
        return MilpResult(
            status="optimal",
            energy_joules=cost.energy_joules,
            lower_bound_joules=graph.compute_joules,
            gap=0.0,
            solve_seconds=time.perf_counter() - began,
            evaluation=cost,
            plan=everything,
            message="keep-everything fits: its energy is the every-node-once lower bound",
            **common,
        )
    if runtime is not None and graph.compute_seconds > runtime * (1 + 1e-12):
        return MilpResult(
            status="infeasible",
            energy_joules=None,
            lower_bound_joules=None,
            gap=None,
            solve_seconds=time.perf_counter() - began,
            message="the runtime budget is below one computation of every node",
            **common,
        )

    if progress is not None:
        progress(time.perf_counter() - began, None, None)  # solving starts: say so at once
    start_plan: dict[str, np.ndarray] | None = None
    warm = ""
    given = math.inf
    if initial_plan is not None:
        given = _usable(graph, initial_plan, ram_bytes, runtime, mode, accounting, runnable)
        if math.isfinite(given):
            start_plan = {key: np.asarray(initial_plan[key]) for key in MATRICES}
            warm = f"; started from the given plan ({given:.6g} J)"
    if warm_start and (mode == "hybrid" or len(graph) >= WARM_MIN_NODES):
        # The same MILP over a neighbourhood of plausible plans (a few percent of the variables,
        # see _neighbourhood) finds a plan at or near the optimum in seconds; HiGHS starts the
        # full model from it, so its own time goes into the lower bound.
        found, energy = _restricted(
            graph,
            ram_bytes,
            runtime,
            mode,
            accounting,
            WARM_SHARE * time_limit,
            threads,
            progress,
            began,
            runnable,
        )
        if found is not None and energy < given:
            start_plan = found
            warm = (
                f"; started from a restricted search's plan ({energy:.6g} J, found in "
                f"{time.perf_counter() - began:.1f} s)"
            )
    model, variables, obj_scale, _ = _build(
        graph, ram_bytes, runtime, mode, accounting, runnable=runnable
    )
    start = None if start_plan is None else _start_from(start_plan, variables)
    # HiGHS can overrun its limit by a few seconds on a loaded machine: keep a margin.
    left = max((1 - TIME_MARGIN) * time_limit - (time.perf_counter() - began), 0.5)
    status, highspy, values, _objective, dual, seconds = _run(
        model, left, rel_gap, threads, progress, obj_scale, start
    )
    size: dict[str, Any] = {"variables": model.num_cols, "constraints": model.num_rows}
    ms = highspy.HighsModelStatus
    if values is not None and status not in (ms.kInfeasible,):
        plan = _plan_from(values, variables)
        broken = violations(graph, plan, accounting, runnable=runnable)
        if broken:
            raise AssertionError(f"the MILP returned an invalid plan: {broken[0]}")
        result = evaluate(graph, plan, accounting)
        energy = result.energy_joules
        optimal = status == ms.kOptimal
        bound = energy if optimal and dual is None else dual
        if bound is not None:
            bound = min(bound, energy)
        gap = 0.0 if energy == 0 else (energy - bound) / energy if bound is not None else None
        return MilpResult(
            status="optimal" if optimal else "feasible",
            energy_joules=energy,
            lower_bound_joules=bound,
            gap=gap,
            solve_seconds=time.perf_counter() - began,
            evaluation=result,
            plan=plan,
            message=f"HiGHS: {_status_text(status)} in {seconds:.2f} s{warm}",
            **size,
            **common,
        )
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        # Every variable is bounded and costs are >= 0: "unbounded or infeasible" is infeasible.
        smallest = None
        note = ""
        if find_smallest_ram and ram_bytes is not None:
            left = max((1 - TIME_MARGIN) * time_limit - (time.perf_counter() - began), 1.0)
            smallest, note = _smallest_ram(
                graph, runtime, mode, accounting, left, threads, runnable
            )
        return MilpResult(
            status="infeasible",
            energy_joules=None,
            lower_bound_joules=None,
            gap=None,
            solve_seconds=time.perf_counter() - began,
            smallest_ram_bytes=smallest,
            message=f"HiGHS proved the budgets infeasible in {seconds:.2f} s{note}",
            **size,
            **common,
        )
    return MilpResult(
        status="no_solution",
        energy_joules=None,
        lower_bound_joules=dual,
        gap=None,
        solve_seconds=time.perf_counter() - began,
        message=(
            f"HiGHS: {_status_text(status)} after {seconds:.2f} s "
            "without a plan; raise --time-limit"
        ),
        **size,
        **common,
    )


def _usable(
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


def _restricted(
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
    """The best plan of the MILP restricted to :func:`_neighbourhood` within ``time_limit``
    (a valid plan of the full problem, checked), and its energy (J); (None, nan) without one."""
    model, variables, obj_scale, _ = _build(
        graph,
        ram,
        runtime,
        mode,
        accounting,
        allowed=_neighbourhood(graph),
        strengthen=False,
        runnable=runnable,
    )
    report = None
    if progress is not None:
        outer = progress

        def report(_elapsed: float, best: float | None, _bound: float | None) -> None:
            # The restricted bound is not a bound of the full problem: report the plan only.
            outer(time.perf_counter() - began, best, None)

    _status, _highspy, values, _objective, _dual, _seconds = _run(
        model, max(time_limit, 0.5), WARM_REL_GAP, threads, report, obj_scale
    )
    if values is None:
        return None, math.nan
    plan = _plan_from(values, variables)
    if violations(graph, plan, accounting, runnable=runnable):
        return None, math.nan
    cost = evaluate(graph, plan, accounting)
    if ram is not None and cost.peak_ram_bytes > ram * (1 + 1e-9):
        return None, math.nan
    return plan, cost.energy_joules


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
    model, variables, _, _ = _build(
        graph, None, runtime, mode, accounting, minimise_ram=True, runnable=runnable
    )
    status, highspy, values, _objective, _dual, _seconds = _run(
        model, time_limit, 1e-9, threads, None, 1.0
    )
    ms = highspy.HighsModelStatus
    if status == ms.kOptimal and values is not None:
        plan = _plan_from(values, variables)
        peak = evaluate(graph, plan, accounting).peak_ram_bytes
        return peak, f"; the smallest RAM for this runtime is {peak:.0f} bytes"
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return None, "; no RAM budget meets this runtime budget"
    return None, "; the smallest feasible RAM was not proven within the time limit"


def _runnable_rows(
    model: _Model,
    graph: TrainingGraph,
    r: np.ndarray,
    s_ram: np.ndarray,
    p_in: np.ndarray,
    p_out: np.ndarray,
    *,
    retains: bool = True,
) -> None:
    """Restrict the plans to what an executor of chain schedules can run, and count what
    autograd retains as that executor does.

    * Only the graph a backward reads retains what autograd saved with it (a stage's input):
      ``g[t]`` (continuous, ≥ 0) is forced to 1 when the copy of a forward node entering stage
      ``t`` is the one its backward will read (kept in RAM, not recomputed, up to the
      backward), and only then must the retained node be in RAM. A forward node recomputed
      without grad (a checkpoint, ``Fn``/``Fc``) retains nothing, as in
      :func:`~edgetrain.core.schedule.simulate`. (Without ``runnable`` every held copy retains.)

    * A forward node in RAM entering a stage is not computed or paged in again in it, nor both
      in one stage (one copy of a value).
    * The model's output (the forward node the loss reads) stays in RAM up to its backward, and
      no forward node is computed after its backward.
    * Only forward nodes are paged (an executor pages activations, not gradients), and not the
      model's output (the caller holds it).
    * A backward reads its own forward node (the graph autograd built: an edge from a forward
      node to a backward node of the same ``stage``) as computed in RAM, never paged back in:
      ``h[t]`` (continuous, ≥ 0) is forced to 1 when the copy of the forward node entering stage
      ``t`` was paged in and not recomputed since, and must be 0 at the backward unless the
      backward's stage recomputes it.
    * A page is read exactly once and written only when the last one was read: page-ins up to
      stage ``t`` ≤ page-outs before ``t``; page-outs up to ``t`` ≤ page-ins before ``t`` + 1;
      page-outs ≤ page-ins in all.
    """
    inf = math.inf
    t_count = len(graph)
    nodes = graph.nodes
    reader = graph.graph_readers()
    for i, node in enumerate(nodes):
        # A forward node in RAM is not computed or paged in again, nor both in one stage: an
        # executor holds one copy of a value.
        if not node.backward:
            for t in range(i + 1, t_count):
                model.row([(r[t, i], 1.0), (s_ram[t, i], 1.0), (p_in[t, i], 1.0)], -inf, 1.0)
    for f, read_at in reader.items():
        # Nothing reads a forward node after its backward: it is not computed again then.
        for t in range(read_at + 1, t_count):
            model.upper[int(r[t, f])] = 0.0
    for v, u in graph.retains if retains else ():
        graph_read = reader.get(v)
        if graph_read is None:  # no backward reads it: every held copy retains
            for t in range(max(u, v) + 1, t_count):
                model.row([(s_ram[t, v], 1.0), (s_ram[t, u], -1.0)], -inf, 0.0)
            continue
        g_next = -1
        for t in range(graph_read, v, -1):
            g = model.col(0.0, inf, integer=False)
            terms = [(g, 1.0), (s_ram[t, v], -1.0), (r[t, v], 1.0)]
            if g_next >= 0:
                terms.append((g_next, -1.0))
            model.row(terms, -1.0 if g_next >= 0 else 0.0, inf)
            model.row([(g, 1.0), (s_ram[t, u], -1.0)], -inf, 0.0)
            g_next = g
    for f, loss in graph.unique_edges:
        # The model's output (read by the loss, stage -1) is the caller's until the step ends,
        # and its graph is built once, in the forward pass: it stays in RAM up to its backward.
        if nodes[loss].stage == -1 and not nodes[f].backward:
            backward = [v for v in graph.successors(f) if nodes[v].backward and v != loss]
            for t in range(f + 1, max(backward, default=loss) + 1):
                model.lower[int(s_ram[t, f])] = 1.0
    if (p_in < 0).all():
        return  # no paging variables: nothing more to restrict
    output = {f for f, v in graph.unique_edges if nodes[v].stage == -1 and not nodes[f].backward}
    for i, node in enumerate(nodes):
        if node.backward or i in output:  # gradients, and the output the caller holds
            for cols in (p_in[:, i], p_out[:, i]):
                for col in cols[cols >= 0].tolist():
                    model.upper[col] = 0.0
    for f, b in reader.items():
        h_prev = -1
        for t in range(f, b):
            h = model.col(0.0, inf, integer=False)
            # entering t+1: paged in during t, kept, not recomputed in t
            model.row(
                [(h, 1.0), (p_in[t, f], -1.0), (s_ram[t + 1, f], -1.0), (r[t, f], 1.0)],
                -1.0,
                inf,
            )
            if h_prev >= 0:
                model.row(
                    [(h, 1.0), (h_prev, -1.0), (s_ram[t + 1, f], -1.0), (r[t, f], 1.0)],
                    -1.0,
                    inf,
                )
            h_prev = h
        if h_prev >= 0:
            model.row([(h_prev, 1.0), (r[b, f], -1.0)], -inf, 0.0)
    for i, node in enumerate(nodes):
        if node.backward:
            continue
        # Every page written is read (a page nobody reads is energy spent for nothing).
        model.row(
            [(p_out[t, i], 1.0) for t in range(i + 1, t_count)]
            + [(p_in[t, i], -1.0) for t in range(i + 1, t_count)],
            -inf,
            0.0,
        )
        for t in range(i + 1, t_count):
            ins = [(p_in[s, i], 1.0) for s in range(t + 1)]
            outs_before = [(p_out[s, i], -1.0) for s in range(t)]
            model.row(ins + outs_before, -inf, 0.0)
            outs = [(p_out[s, i], 1.0) for s in range(t + 1)]
            ins_before = [(p_in[s, i], -1.0) for s in range(t)]
            model.row(outs + ins_before, -inf, 1.0)


def _status_text(status: Any) -> str:
    import highspy

    return str(highspy.Highs().modelStatusToString(status))  # type: ignore[no-untyped-call]
