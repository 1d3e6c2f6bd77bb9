"""Check a POET plan (R, S_ram, S_flash, page_in, page_out) against POET's constraints (pure).

Independent of the MILP that produced it: this module re-derives everything from the five 0/1
matrices (``T × T``, row = stage ``t``, column = node ``i``) and the graph. :func:`violations`
lists every constraint a plan breaks; :func:`evaluate` computes its memory (POET's per-node
recurrence, with ``Free`` derived from its definition, not read from the solver), its runtime and
its energy split, under either accounting:

``poet``
    exactly POET's problem (Patil et al., ICML 2022): runtime = compute only, memory per POET's
    recurrence over the edge list as given (parallel edges free twice), a page-in counts from the
    next stage.
``edgetrain``
    runtime also counts paging time; a value paged in during stage ``t`` occupies RAM during ``t``;
    parallel edges free once; the graph's ``held`` bytes count from their stages on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from edgetrain.planners.poet.graph import TrainingGraph

Accounting = Literal["poet", "edgetrain"]
ACCOUNTINGS: tuple[Accounting, ...] = ("poet", "edgetrain")
MATRICES = ("R", "S_ram", "S_flash", "page_in", "page_out")


@dataclass(frozen=True)
class Evaluation:
    """What a plan costs.

    Attributes:
        peak_ram_bytes: the largest ``U[t][k]`` (bytes).
        runtime_seconds: compute time, plus paging time under the ``edgetrain`` accounting (s).
        compute_joules / pagein_joules / pageout_joules: the energy split (J).
        recomputed: computations beyond one per node (``sum(R) - T``).
        paged_out / paged_in: page-out and page-in operations.
    """

    peak_ram_bytes: float
    runtime_seconds: float
    compute_joules: float
    pagein_joules: float
    pageout_joules: float
    recomputed: int
    paged_out: int
    paged_in: int

    @property
    def energy_joules(self) -> float:
        """Total energy (J)."""
        return self.compute_joules + self.pagein_joules + self.pageout_joules


def _arrays(plan: dict[str, np.ndarray], t: int) -> dict[str, np.ndarray]:
    out = {}
    for key in MATRICES:
        value = np.asarray(plan[key])
        if value.shape != (t, t):
            raise ValueError(f"{key} has shape {value.shape}, expected ({t}, {t})")
        out[key] = np.rint(value).astype(np.int64)
    return out


def violations(
    graph: TrainingGraph,
    plan: dict[str, np.ndarray],
    accounting: Accounting = "poet",
    *,
    runnable: bool = False,
) -> list[str]:
    """Every structural constraint of POET's problem the plan breaks (empty when it is valid).

    Checked: 0/1 values; R lower triangular with a full diagonal (stage t computes node t);
    S_ram, S_flash, page_in, page_out zero for ``i >= t``; every edge ``(u, v)`` computed in ``t``
    has ``u`` computed in ``t`` or in RAM entering ``t``; ``S_ram[t+1] <= S_ram[t] + R[t] +
    page_in[t]``; ``S_flash[t+1] <= S_flash[t] + page_out[t]``; page_in needs S_flash, page_out
    needs S_ram; under the ``edgetrain`` accounting, a held node holds what it ``retains`` —
    with ``runnable`` (plans for a chain executor, see :func:`edgetrain.planners.poet.milp.solve`),
    only the copy of a forward node its backward reads (kept in RAM, not recomputed, up to the
    backward) retains.
    """
    t_count = len(graph)
    m = _arrays(plan, t_count)
    bad: list[str] = []
    for key, value in m.items():
        if not np.isin(value, (0, 1)).all():
            bad.append(f"{key} has values other than 0 and 1")
    r = m["R"]
    upper = np.triu(np.ones((t_count, t_count), dtype=bool), 1)
    on_or_above = np.triu(np.ones((t_count, t_count), dtype=bool), 0)
    if r[upper].any():
        bad.append("R computes a node after its own stage (R[t][i] = 1 for i > t)")
    if not (np.diag(r) == 1).all():
        t = int(np.flatnonzero(np.diag(r) != 1)[0])
        bad.append(f"stage {t} does not compute node {t} (R[t][t] = 0)")
    for key in ("S_ram", "S_flash", "page_in", "page_out"):
        if m[key][on_or_above].any():
            bad.append(f"{key}[t][i] = 1 for some i >= t")
    for u, v in graph.unique_edges:
        need = r[:, v] > r[:, u] + m["S_ram"][:, u]
        if need.any():
            t = int(np.flatnonzero(need)[0])
            bad.append(f"stage {t} computes {v} without its input {u} in RAM")
    s_ram, s_flash = m["S_ram"], m["S_flash"]
    grow = s_ram[1:] > s_ram[:-1] + r[:-1] + m["page_in"][:-1]
    if grow.any():
        t, i = (int(x) for x in np.argwhere(grow)[0])
        bad.append(f"node {i} is in RAM entering stage {t + 1} without being computed or paged in")
    grow = s_flash[1:] > s_flash[:-1] + m["page_out"][:-1]
    if grow.any():
        t, i = (int(x) for x in np.argwhere(grow)[0])
        bad.append(f"node {i} is on flash entering stage {t + 1} without being paged out")
    if (m["page_in"] > s_flash).any():
        bad.append("a page-in reads a value that is not on flash")
    if (m["page_out"] > s_ram).any():
        bad.append("a page-out writes a value that is not in RAM")
    if accounting == "edgetrain":
        readers = graph.graph_readers() if runnable else {}
        for v, u in graph.retains:
            held = s_ram[:, v].astype(bool)
            b = readers.get(v)
            if b is not None:
                held = np.zeros(t_count, dtype=bool)
                for t in range(b, v, -1):
                    held[t] = bool(s_ram[t, v]) and not r[t, v] and (t == b or held[t + 1])
            if (held & (s_ram[:, u] == 0)).any():
                bad.append(f"node {v} is held without node {u}, which it retains")
    return bad


def memory(
    graph: TrainingGraph, plan: dict[str, np.ndarray], accounting: Accounting = "poet"
) -> np.ndarray:
    """The memory levels (bytes) the RAM budget bounds, ``[t][k]`` for stage ``t``, node ``k``.

    ``Free[t](i, k)`` is derived from its definition: the input ``i`` of an edge ``(i, k)`` is freed
    once ``k`` has run in ``t`` exactly when ``i`` is not in RAM entering ``t + 1`` (ignored at the
    last stage) and no later successor of ``i`` runs in ``t``.

    ``poet``: POET's recurrence as its code has it, ``U[t][0] = R[t][0]·m0 + Σ S_ram[t][i]·m_i``,
    ``U[t][k] = U[t][k-1] + R[t][k]·m_k − Σ_{edges (i, k-1)} m_i·Free[t](i, k-1)``: the inputs of
    node ``k-1`` leave when node ``k`` is added (edges repeated as listed).

    ``edgetrain``: the level while node ``k`` runs, its inputs, its output and its transient
    ``workspace_bytes`` held at once: ``during[t][k] = after[t][k-1] + R[t][k]·(m_k + w_k)``,
    ``after[t][k] = after[t][k-1] + R[t][k]·m_k − Σ_{edges (i, k)} m_i·Free[t](i, k)`` (each edge
    once), starting from ``S_ram[t]``, the values paged in during ``t`` and the graph's ``held``
    bytes whose stage is ``<= t``.
    """
    t_count = len(graph)
    m = _arrays(plan, t_count)
    r, s_ram = m["R"], m["S_ram"]
    size = np.array([n.output_bytes for n in graph.nodes], dtype=np.float64)
    work = np.array([n.workspace_bytes for n in graph.nodes], dtype=np.float64)
    poet = accounting == "poet"
    edges = graph.edges if poet else graph.unique_edges
    incoming: list[list[int]] = [[] for _ in range(t_count)]
    for i, k in edges:
        incoming[k].append(i)

    def freed(t: int, k: int) -> float:
        if not r[t, k]:
            return 0.0
        total = 0.0
        for i in incoming[k]:
            kept = t + 1 < t_count and s_ram[t + 1, i] == 1
            later = any(r[t, j] for j in graph.successors(i) if j > k)
            if not kept and not later:
                total += size[i]
        return total

    u = np.zeros((t_count, t_count))
    for t in range(t_count):
        base = float(s_ram[t] @ size)
        if not poet:
            base += float(m["page_in"][t] @ size)
            base += sum(size for stage, size in graph.held if stage <= t)
        level = base + r[t, 0] * size[0]
        u[t, 0] = level + (0.0 if poet else r[t, 0] * work[0])
        if not poet:
            level -= freed(t, 0)
        for k in range(1, t_count):
            if poet:
                level += r[t, k] * size[k] - freed(t, k - 1)
                u[t, k] = level
            else:
                level += r[t, k] * size[k]
                u[t, k] = level + r[t, k] * work[k]
                level -= freed(t, k)
    return u


def evaluate(
    graph: TrainingGraph, plan: dict[str, np.ndarray], accounting: Accounting = "poet"
) -> Evaluation:
    """Peak memory, runtime and energy of a plan under ``accounting``."""
    t_count = len(graph)
    m = _arrays(plan, t_count)
    nodes = graph.nodes
    seconds = np.array([n.compute_seconds for n in nodes])
    joules = np.array([n.compute_joules for n in nodes])
    in_j = np.array([n.pagein_joules for n in nodes])
    out_j = np.array([n.pageout_joules for n in nodes])
    runtime = float(m["R"].sum(axis=0) @ seconds)
    if accounting == "edgetrain":
        runtime += float(m["page_in"].sum(axis=0) @ np.array([n.pagein_seconds for n in nodes]))
        runtime += float(m["page_out"].sum(axis=0) @ np.array([n.pageout_seconds for n in nodes]))
    return Evaluation(
        peak_ram_bytes=float(memory(graph, plan, accounting).max()),
        runtime_seconds=runtime,
        compute_joules=float(m["R"].sum(axis=0) @ joules),
        pagein_joules=float(m["page_in"].sum(axis=0) @ in_j),
        pageout_joules=float(m["page_out"].sum(axis=0) @ out_j),
        recomputed=int(m["R"].sum()) - t_count,
        paged_out=int(m["page_out"].sum()),
        paged_in=int(m["page_in"].sum()),
    )


def store_all(graph: TrainingGraph) -> dict[str, np.ndarray]:
    """The keep-everything plan: each node computed once and kept while a later node reads it."""
    t_count = len(graph)
    r = np.eye(t_count, dtype=np.int64)
    s_ram = np.zeros((t_count, t_count), dtype=np.int64)
    for i in range(t_count):
        succ = graph.successors(i)
        if succ:
            s_ram[i + 1 : max(succ) + 1, i] = 1
    return remat_plan(r, s_ram)


def remat_plan(r: np.ndarray, s_ram: np.ndarray) -> dict[str, np.ndarray]:
    """A plan of recomputation only: ``R`` and ``S_ram`` as given, nothing on flash or paged."""
    zero = np.zeros_like(r)
    return {
        "R": r,
        "S_ram": s_ram,
        "S_flash": zero,
        "page_in": zero.copy(),
        "page_out": zero.copy(),
    }
