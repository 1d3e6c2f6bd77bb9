"""POET's MILP written out, one constraint family per function (:func:`build` calls them in order).

Notation: ``T`` stages and nodes; stage ``t`` computes node ``t`` and may recompute earlier ones.
``R[t][i]`` (computed in ``t``), ``S_ram[t][i]`` / ``S_flash[t][i]`` (in RAM / on flash entering
``t``), ``page_in[t][i]`` / ``page_out[t][i]`` (paged during ``t``) are binaries; ``m_i`` is node
``i``'s output bytes. Memory rows are in units of 1 % of the largest ``m_i``; the objective is
scaled so the every-node-once energy is :data:`OBJECTIVE_SCALE`. Why each family has the shape it
has (and what is not POET's) is in :mod:`edgetrain.planners.poet.milp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from edgetrain.planners.poet.check import Accounting
from edgetrain.planners.poet.graph import TrainingGraph
from edgetrain.planners.poet.model import MilpModel, Variables
from edgetrain.planners.poet.runnable import runnable_rows

Mode = Literal["hybrid", "remat", "paging"]
MODES: tuple[Mode, ...] = ("hybrid", "remat", "paging")
OBJECTIVE_SCALE = 1e6
"""The every-node-once energy (a lower bound) is scaled to this many objective units."""

INF = math.inf


@dataclass(frozen=True)
class _Units:
    """Node sizes and the unit of the memory rows (bytes per unit)."""

    size: np.ndarray  # output bytes per node
    work: np.ndarray  # workspace bytes per node
    mem_scale: float


def build(
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
) -> tuple[MilpModel, Variables, float, float]:
    """The MILP; returns (model, variables, objective scale, memory scale).

    ``allowed`` (boolean ``T × T`` masks for ``R``, ``page_in`` and ``page_out``, see
    :func:`edgetrain.planners.poet.warmstart.neighbourhood`) restricts the search: a variable
    outside its mask is never created, i.e. fixed at 0. The restricted MILP is a heuristic for a
    start, never the answer. ``strengthen`` adds the valid inequalities of :func:`_reacquire`;
    ``pin_free`` writes ``Free``'s lower side for every edge (same optimum, more rows).
    """
    size = np.array([n.output_bytes for n in graph.nodes])
    work = np.array([n.workspace_bytes for n in graph.nodes])
    units = _Units(size, work, max(float(size.max()), 1.0) / 100.0)
    lower = graph.compute_joules
    obj_scale = OBJECTIVE_SCALE / lower if lower > 0 else OBJECTIVE_SCALE
    paging = mode != "remat"
    model = MilpModel()
    v = _variables(model, graph, mode, obj_scale, minimise_ram, allowed)
    ram_limit = INF if (ram is None or minimise_ram) else ram / units.mem_scale
    _computed_from_inputs_in_ram(model, graph, v)
    _carried_into_next_stage(model, graph, v, paging, strengthen)
    if paging and strengthen:
        _reacquire(model, graph, v.r, v.s_ram, v.s_flash)
    if accounting == "edgetrain" and not runnable:
        _retained_values(model, graph, v)
    if paging:
        _paging_needs(model, graph, v)
    if runnable:
        runnable_rows(model, graph, v, retains=accounting == "edgetrain")
    frees = _free_indicators(model, graph, v, accounting, pin_free)
    _memory_levels(model, graph, v, frees, accounting, ram_limit, units)
    if runtime is not None:
        _runtime(model, graph, v, runtime, accounting, paging)
    return model, v, obj_scale, units.mem_scale


def _variables(
    model: MilpModel,
    graph: TrainingGraph,
    mode: Mode,
    obj_scale: float,
    minimise_ram: bool,
    allowed: dict[str, np.ndarray] | None,
) -> Variables:
    """The columns, stage by stage: ``R[t][i]`` for ``i ≤ t`` (``R[t][t] = 1``; ``R[t][i<t] = 0``
    in ``paging`` mode), then ``S_ram[t][i]``, ``S_flash[t][i]`` (``= 0`` for ``i = t − 1``),
    ``page_in[t][i]``, ``page_out[t][i]`` for ``i < t`` (no paging columns in ``remat`` mode);
    a column outside ``allowed`` is never created. Costs: energy ``R·e_compute + page_in·e_in
    + page_out·e_out`` (times ``obj_scale``), or, with ``minimise_ram``, the RAM budget alone
    (a last continuous column ``budget ≥ 0`` of cost 1)."""
    t_count = len(graph)
    nodes = graph.nodes
    paging = mode != "remat"
    remat = mode != "paging"
    none = np.full((t_count, t_count), -1, dtype=np.int64)
    r, s_ram, s_flash, p_in, p_out = (none.copy() for _ in range(5))

    def may(key: str, t: int, i: int) -> bool:
        return allowed is None or bool(allowed[key][t, i])

    def cost(joules: float) -> float:
        return 0.0 if minimise_ram else joules * obj_scale

    for t in range(t_count):
        for i in range(t + 1):
            if i < t and not may("R", t, i):
                continue
            fixed = 1.0 if i == t else None
            upper = 1.0 if (remat or i == t) else 0.0
            r[t, i] = model.col(
                fixed or 0.0, fixed or upper, integer=True, cost=cost(nodes[i].compute_joules)
            )
        for i in range(t):
            s_ram[t, i] = model.col(0.0, 1.0, integer=True)
            if paging:
                s_flash[t, i] = model.col(0.0, 1.0 if i < t - 1 else 0.0, integer=True)
                if may("page_in", t, i):
                    p_in[t, i] = model.col(
                        0.0, 1.0, integer=True, cost=cost(nodes[i].pagein_joules)
                    )
                if may("page_out", t, i):
                    p_out[t, i] = model.col(
                        0.0, 1.0, integer=True, cost=cost(nodes[i].pageout_joules)
                    )
    budget_col = model.col(0.0, INF, integer=False, cost=1.0) if minimise_ram else -1
    return Variables(r, s_ram, s_flash, p_in, p_out, budget_col)


def _computed_from_inputs_in_ram(model: MilpModel, graph: TrainingGraph, v: Variables) -> None:
    """A value is computed from inputs in RAM: for each distinct edge ``(u, v)`` and ``t ≥ v``,

    R[t][v] ≤ R[t][u] + S_ram[t][u]
    """
    for u, w in graph.unique_edges:
        for t in range(w, len(graph)):
            model.row([(v.r[t, w], 1.0), (v.r[t, u], -1.0), (v.s_ram[t, u], -1.0)], -INF, 0.0)


def _carried_into_next_stage(
    model: MilpModel, graph: TrainingGraph, v: Variables, paging: bool, strengthen: bool
) -> None:
    """What is in RAM or on flash entering ``t+1`` was there, computed or paged during ``t``
    (for ``i ≤ t``; the flash row follows each RAM row, with paging):

        S_ram[t+1][i] ≤ S_ram[t][i] + R[t][i] + page_in[t][i]
        S_flash[t+1][i] = S_flash[t][i] + page_out[t][i]     (``≤`` without ``strengthen``)

    The flash equality is stronger than POET's ``≤``: flash keeps what was paged out, and a node
    is paged out at most once (keeping a value on flash is free, a second page-out only costs), so
    some optimal plan has ``S_flash`` non-decreasing with one page-out per node.
    """
    for t in range(len(graph) - 1):
        for i in range(t + 1):
            model.row(
                [
                    (v.s_ram[t + 1, i], 1.0),
                    (v.s_ram[t, i], -1.0),
                    (v.r[t, i], -1.0),
                    (v.page_in[t, i], -1.0),
                ],
                -INF,
                0.0,
            )
            if paging:
                model.row(
                    [(v.s_flash[t + 1, i], 1.0), (v.s_flash[t, i], -1.0), (v.page_out[t, i], -1.0)],
                    0.0 if strengthen else -INF,
                    0.0,
                )


def _reacquire(
    model: MilpModel, graph: TrainingGraph, r: np.ndarray, s_ram: np.ndarray, s_flash: np.ndarray
) -> None:
    """Valid inequalities that stop the LP relaxation from paging a value back in by slivers.

    Alone, ``S_ram[t+1] ≤ S_ram[t] + R[t] + page_in[t]`` and ``page_in[t] ≤ S_flash[t]`` let the
    relaxation page out 3 % of a value once and page in 3 % at each of 30 stages, so that it is
    back in RAM at the cost of a page-in alone (POET's ResNet-18: the root bound then sees a
    fraction of the paging energy). Keeping a value on flash costs nothing, so some optimal plan
    has ``S_flash`` non-decreasing (:func:`_carried_into_next_stage` asks it); then a value in RAM
    entering ``t'`` was in RAM entering some earlier ``t``, or computed in between, or is on flash
    entering ``t' − 1``:

        S_ram[t'][i] ≤ min_{t < t'} (S_ram[t][i] + Σ_{t ≤ s < t'} R[s][i]) + S_flash[t'−1][i]

    The minimum is a continuous ``W[t'][i]`` with ``W[t'] ≤ W[t'−1] + R[t'−1]`` and ``W[t'] ≤
    S_ram[t'−1] + R[t'−1]``. Written for ``i + 2 ≤ t' ≤`` the last reader of ``i`` (only there
    can a value be dropped and needed again), at most ``T²/2`` columns and ``3 T²/2`` rows.
    """
    for i in range(len(graph)):
        previous = -1  # W[i+1][i] would be 1 (node i runs in stage i): no row needed
        last = max(graph.successors(i), default=i)
        for t in range(i + 2, last + 1):
            w = model.col(0.0, 1.0, integer=False)
            if previous >= 0:
                model.row([(w, 1.0), (previous, -1.0), (r[t - 1, i], -1.0)], -INF, 0.0)
            model.row([(w, 1.0), (s_ram[t - 1, i], -1.0), (r[t - 1, i], -1.0)], -INF, 0.0)
            model.row([(s_ram[t, i], 1.0), (w, -1.0), (s_flash[t - 1, i], -1.0)], -INF, 0.0)
            previous = w


def _retained_values(model: MilpModel, graph: TrainingGraph, v: Variables) -> None:
    """A held value keeps what autograd saved with it (``edgetrain`` accounting; with
    ``runnable``, :mod:`edgetrain.planners.poet.runnable` writes a finer version): for each
    ``retains`` pair ``(w, u)`` and ``t > max(u, w)``,

        S_ram[t][w] ≤ S_ram[t][u]
    """
    for w, u in graph.retains:
        for t in range(max(u, w) + 1, len(graph)):
            model.row([(v.s_ram[t, w], 1.0), (v.s_ram[t, u], -1.0)], -INF, 0.0)


def _paging_needs(model: MilpModel, graph: TrainingGraph, v: Variables) -> None:
    """A page-in reads flash, a page-out reads RAM: for ``i < t`` (where the column exists),

    page_in[t][i] ≤ S_flash[t][i]        page_out[t][i] ≤ S_ram[t][i]
    """
    for t in range(len(graph)):
        for i in range(t):
            if v.page_in[t, i] >= 0:
                model.row([(v.page_in[t, i], 1.0), (v.s_flash[t, i], -1.0)], -INF, 0.0)
            if v.page_out[t, i] >= 0:
                model.row([(v.page_out[t, i], 1.0), (v.s_ram[t, i], -1.0)], -INF, 0.0)


@dataclass(frozen=True)
class _Frees:
    """The ``Free`` columns: ``into[k]`` lists ``(i, multiplicity, edge index)`` of the distinct
    edges into ``k``; ``free[t, edge index]`` is the column of ``Free[t](i, k)``."""

    into: list[list[tuple[int, int, int]]]
    free: dict[tuple[int, int], int]

    def terms(self, t: int, k: int, units: _Units) -> list[tuple[int, float]]:
        """What is freed after ``k`` runs in ``t``: ``Σ_i mult · Free[t](i, k) · m_i`` (units)."""
        return [
            (self.free[t, e_idx], mult * units.size[i] / units.mem_scale)
            for i, mult, e_idx in self.into[k]
            if (t, e_idx) in self.free
        ]


def _free_indicators(
    model: MilpModel, graph: TrainingGraph, v: Variables, accounting: Accounting, pin_free: bool
) -> _Frees:
    """``Free[t](i, k)`` (continuous in [0, 1]), one per distinct edge ``(i, k)`` and stage ``t``
    that runs ``k``: ``i``'s output may be freed after ``k`` runs in ``t``. Upper sides only:

        Free ≤ R[t][k]      Free ≤ 1 − S_ram[t+1][i]      Free ≤ 1 − R[t][j]  (later j, k < j ≤ t)

    and, for a parallel edge (weighted by its multiplicity under the ``poet`` accounting, which
    frees it twice) or with ``pin_free``, the lower side
    ``Free ≥ R[t][k] − S_ram[t+1][i] − Σ_j R[t][j]``. A smaller ``Free`` only overstates memory,
    so the solver takes the 0/1 value whenever it matters.
    """
    t_count = len(graph)
    multiplicity: dict[tuple[int, int], int] = {}
    for e in graph.edges:
        multiplicity[e] = multiplicity.get(e, 0) + 1 if accounting == "poet" else 1
    into: list[list[tuple[int, int, int]]] = [[] for _ in range(t_count)]  # k -> (i, mult, idx)
    for e_idx, ((i, k), mult) in enumerate(multiplicity.items()):
        into[k].append((i, mult, e_idx))
    free: dict[tuple[int, int], int] = {}
    for t in range(t_count):
        for k in range(t + 1):
            if v.r[t, k] < 0:
                continue  # k does not run in t: nothing is freed after it
            for i, mult, e_idx in into[k]:
                f = model.col(0.0, 1.0, integer=False)
                free[t, e_idx] = f
                later = [j for j in graph.successors(i) if k < j <= t and v.r[t, j] >= 0]
                keep = v.s_ram[t + 1, i] if t + 1 < t_count else -1
                model.row([(f, 1.0), (v.r[t, k], -1.0)], -INF, 0.0)
                if keep >= 0:
                    model.row([(f, 1.0), (keep, 1.0)], -INF, 1.0)
                for j in later:
                    model.row([(f, 1.0), (v.r[t, j], 1.0)], -INF, 1.0)
                if mult > 1 or pin_free:
                    # A value freed once is freed after being counted, so the level never goes
                    # below 0 and Free only needs its upper bounds (a smaller Free overstates
                    # memory, never understates it). A parallel edge frees twice (POET's
                    # accounting) and could push a level below 0: there Free is pinned.
                    model.row(
                        [(f, 1.0), (v.r[t, k], -1.0), (keep, 1.0)]
                        + [(v.r[t, j], 1.0) for j in later],
                        0.0,
                        INF,
                    )
    return _Frees(into, free)


def _memory_levels(
    model: MilpModel,
    graph: TrainingGraph,
    v: Variables,
    frees: _Frees,
    accounting: Accounting,
    ram_limit: float,
    units: _Units,
) -> None:
    """Memory within the budget at every step of every stage, under each accounting: what is
    held entering ``t`` is ``Σ_{i<t} S_ram[t][i]·m_i`` (``edgetrain``: plus
    ``Σ_{i<t} page_in[t][i]·m_i`` and the graph's ``held`` bytes from their stage on); see
    :func:`_poet_levels` and :func:`_edgetrain_levels` for the levels while each node runs."""
    size, mem_scale = units.size, units.mem_scale
    for t in range(len(graph)):
        base: list[tuple[int, float]] = [(v.s_ram[t, i], size[i] / mem_scale) for i in range(t)]
        if accounting == "poet":
            _poet_levels(model, graph, v, frees, t, base, ram_limit, units)
            continue
        base += [(v.page_in[t, i], size[i] / mem_scale) for i in range(t)]
        held = sum(size for stage, size in graph.held if stage <= t) / mem_scale
        _edgetrain_levels(model, v, frees, t, base, ram_limit - held, held, units)


def _poet_levels(
    model: MilpModel,
    graph: TrainingGraph,
    v: Variables,
    frees: _Frees,
    t: int,
    base: list[tuple[int, float]],
    ram_limit: float,
    units: _Units,
) -> None:
    """POET's levels ``U[t][k]`` in ``[0, budget]`` for ``k = 0 .. min(t+1, T−1)`` (later levels
    equal ``U[t][t+1]``):

        U[t][0] = Σ_{i<t} S_ram[t][i]·m_i + R[t][0]·m_0
        U[t][k] = U[t][k−1] + R[t][k]·m_k − Σ_i mult · Free[t](i, k−1)·m_i   (``R`` term for k ≤ t)

    With the budget a variable, ``U[t][k] ≤ budget``.
    """
    size, mem_scale = units.size, units.mem_scale
    levels = [model.col(0.0, ram_limit, integer=False) for _ in range(min(t + 2, len(graph)))]
    model.row(
        [(levels[0], 1.0), (v.r[t, 0], -size[0] / mem_scale)] + [(c, -w) for c, w in base],
        0.0,
        0.0,
    )
    for k in range(1, len(levels)):
        terms = [(levels[k], 1.0), (levels[k - 1], -1.0)]
        if k <= t:
            terms.append((v.r[t, k], -size[k] / mem_scale))
        terms += frees.terms(t, k - 1, units)
        model.row(terms, 0.0, 0.0)
    if v.budget >= 0:
        for level in levels:
            model.row([(level, 1.0), (v.budget, -1.0)], -INF, 0.0)


def _edgetrain_levels(
    model: MilpModel,
    v: Variables,
    frees: _Frees,
    t: int,
    base: list[tuple[int, float]],
    cap: float,
    held: float,
    units: _Units,
) -> None:
    """The executor's levels: ``after[t][k] ≥ 0`` for ``k = 0 .. t``, what is held after ``k``
    runs; while ``k`` runs, its output and workspace ``w_k`` are held too:

        after[t][−1] + R[t][k]·(m_k + w_k) ≤ budget − held
        after[t][k] = after[t][k−1] + R[t][k]·(m_k + w_k) − Σ_i Free[t](i, k)·m_i

    with ``after[t][−1]`` the level entering ``t``. A node's workspace stays counted in the
    levels after it to the end of the stage (the checker frees it when the node ends, so the
    model's level is never below the checker's). With the budget a variable,
    ``after[t][k−1] + R[t][k]·(m_k + w_k) − budget ≤ −held``.
    """
    after = [model.col(0.0, INF, integer=False) for _ in range(t + 1)]
    previous: list[tuple[int, float]] = [(c, w) for c, w in base]
    for k in range(t + 1):
        during = [*previous, (v.r[t, k], (units.size[k] + units.work[k]) / units.mem_scale)]
        if v.budget >= 0:
            model.row([*during, (v.budget, -1.0)], -INF, -held)
        else:
            model.row(during, -INF, cap)
        model.row(
            [(after[k], 1.0)] + [(c, -w) for c, w in during] + frees.terms(t, k, units), 0.0, 0.0
        )
        previous = [(after[k], 1.0)]


def _runtime(
    model: MilpModel,
    graph: TrainingGraph,
    v: Variables,
    runtime: float,
    accounting: Accounting,
    paging: bool,
) -> None:
    """The runtime budget (scaled by itself): compute time, plus paging time under the
    ``edgetrain`` accounting,

        Σ R[t][i]·s_compute_i (+ Σ page_in[t][i]·s_in_i + page_out[t][i]·s_out_i) ≤ runtime
    """
    nodes = graph.nodes
    t_count = len(graph)
    scale = runtime if runtime > 0 else 1.0
    terms = [
        (v.r[t, i], nodes[i].compute_seconds / scale) for t in range(t_count) for i in range(t + 1)
    ]
    if accounting == "edgetrain" and paging:
        for t in range(t_count):
            for i in range(t):
                terms.append((v.page_in[t, i], nodes[i].pagein_seconds / scale))
                terms.append((v.page_out[t, i], nodes[i].pageout_seconds / scale))
    model.row(terms, -INF, runtime / scale * (1 + 1e-12))
