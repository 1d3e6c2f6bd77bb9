"""Rows that keep the MILP to plans an executor of chain schedules runs exactly.

:func:`runnable_rows` restricts the plans to what an executor of chain schedules can run, and
counts what autograd retains as that executor does
(:mod:`edgetrain.planners.poet.to_schedule` turns such plans into schedules):

* Only the graph a backward reads retains what autograd saved with it (a stage's input):
  ``g[t]`` (continuous, ≥ 0) is forced to 1 when the copy of a forward node entering stage
  ``t`` is the one its backward will read (kept in RAM, not recomputed, up to the
  backward), and only then must the retained node be in RAM. A forward node recomputed
  without grad (a checkpoint, ``Fn``/``Fc``) retains nothing, as in
  :func:`~edgetrain.core.simulator.simulate`. (Without ``runnable`` every held copy retains.)
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

from __future__ import annotations

import math

from edgetrain.planners.poet.graph import TrainingGraph
from edgetrain.planners.poet.model import MilpModel, Variables

INF = math.inf


def runnable_rows(
    model: MilpModel, graph: TrainingGraph, v: Variables, *, retains: bool = True
) -> None:
    """Add the rows and bounds of the module docstring to ``model``, in this order.

    ``retains`` (the ``edgetrain`` accounting) writes what autograd retains; without it the
    ``retains`` pairs are ignored, as POET's accounting does.
    """
    reader = graph.graph_readers()
    _one_copy(model, graph, v)
    _no_forward_after_its_backward(model, graph, v, reader)
    if retains:
        _graph_retains(model, graph, v, reader)
    _output_stays_until_its_backward(model, graph, v)
    if (v.page_in < 0).all():
        return  # no paging variables: nothing more to restrict
    _only_activations_paged(model, graph, v)
    _backward_reads_a_computed_copy(model, v, reader)
    _page_read_once(model, graph, v)


def _one_copy(model: MilpModel, graph: TrainingGraph, v: Variables) -> None:
    """A forward node in RAM is not computed or paged in again, nor both in one stage (an
    executor holds one copy of a value): ``R[t][i] + S_ram[t][i] + page_in[t][i] ≤ 1``."""
    for i, node in enumerate(graph.nodes):
        if not node.backward:
            for t in range(i + 1, len(graph)):
                model.row(
                    [(v.r[t, i], 1.0), (v.s_ram[t, i], 1.0), (v.page_in[t, i], 1.0)], -INF, 1.0
                )


def _no_forward_after_its_backward(
    model: MilpModel, graph: TrainingGraph, v: Variables, reader: dict[int, int]
) -> None:
    """Nothing reads a forward node after its backward: it is not computed again then
    (``R[t][f] = 0`` for ``t`` after the backward that reads ``f``; a bound, no row)."""
    for f, read_at in reader.items():
        for t in range(read_at + 1, len(graph)):
            model.upper[int(v.r[t, f])] = 0.0


def _graph_retains(
    model: MilpModel, graph: TrainingGraph, v: Variables, reader: dict[int, int]
) -> None:
    """Only the copy a backward reads retains what autograd saved with it. For each
    ``retains`` pair ``(w, u)`` whose ``w`` a backward reads at stage ``b``, from ``t = b`` down
    to ``w + 1``:

        g[t] ≥ S_ram[t][w] − R[t][w]             (t = b)
        g[t] ≥ S_ram[t][w] − R[t][w] + g[t+1] − 1  (t < b)
        g[t] ≤ S_ram[t][u]

    When no backward reads ``w``, every held copy retains: ``S_ram[t][w] ≤ S_ram[t][u]``.
    """
    for w, u in graph.retains:
        graph_read = reader.get(w)
        if graph_read is None:  # no backward reads it: every held copy retains
            for t in range(max(u, w) + 1, len(graph)):
                model.row([(v.s_ram[t, w], 1.0), (v.s_ram[t, u], -1.0)], -INF, 0.0)
            continue
        g_next = -1
        for t in range(graph_read, w, -1):
            g = model.col(0.0, INF, integer=False)
            terms = [(g, 1.0), (v.s_ram[t, w], -1.0), (v.r[t, w], 1.0)]
            if g_next >= 0:
                terms.append((g_next, -1.0))
            model.row(terms, -1.0 if g_next >= 0 else 0.0, INF)
            model.row([(g, 1.0), (v.s_ram[t, u], -1.0)], -INF, 0.0)
            g_next = g


def _output_stays_until_its_backward(model: MilpModel, graph: TrainingGraph, v: Variables) -> None:
    """The model's output (read by the loss, stage -1) is the caller's until the step ends, and
    its graph is built once, in the forward pass: ``S_ram[t][f] = 1`` from ``f + 1`` up to its
    backward (a bound, no row)."""
    nodes = graph.nodes
    for f, loss in graph.unique_edges:
        if nodes[loss].stage == -1 and not nodes[f].backward:
            backward = [w for w in graph.successors(f) if nodes[w].backward and w != loss]
            for t in range(f + 1, max(backward, default=loss) + 1):
                model.lower[int(v.s_ram[t, f])] = 1.0


def _only_activations_paged(model: MilpModel, graph: TrainingGraph, v: Variables) -> None:
    """Gradients, and the model's output the caller holds, are never paged (``page_in`` and
    ``page_out`` of those nodes bounded at 0)."""
    nodes = graph.nodes
    output = {f for f, w in graph.unique_edges if nodes[w].stage == -1 and not nodes[f].backward}
    for i, node in enumerate(nodes):
        if node.backward or i in output:
            for cols in (v.page_in[:, i], v.page_out[:, i]):
                for col in cols[cols >= 0].tolist():
                    model.upper[col] = 0.0


def _backward_reads_a_computed_copy(model: MilpModel, v: Variables, reader: dict[int, int]) -> None:
    """A backward ``b`` reads its forward node ``f`` as computed, never paged back in: ``h[t+1]``
    for ``f ≤ t < b`` is 1 when the copy entering ``t + 1`` was paged in and not recomputed since,

        h[t+1] ≥ page_in[t][f] + S_ram[t+1][f] − R[t][f] − 1
        h[t+1] ≥ h[t] + S_ram[t+1][f] − R[t][f] − 1
        h[b] ≤ R[b][f]
    """
    for f, b in reader.items():
        h_prev = -1
        for t in range(f, b):
            h = model.col(0.0, INF, integer=False)
            # entering t+1: paged in during t, kept, not recomputed in t
            model.row(
                [(h, 1.0), (v.page_in[t, f], -1.0), (v.s_ram[t + 1, f], -1.0), (v.r[t, f], 1.0)],
                -1.0,
                INF,
            )
            if h_prev >= 0:
                model.row(
                    [(h, 1.0), (h_prev, -1.0), (v.s_ram[t + 1, f], -1.0), (v.r[t, f], 1.0)],
                    -1.0,
                    INF,
                )
            h_prev = h
        if h_prev >= 0:
            model.row([(h_prev, 1.0), (v.r[b, f], -1.0)], -INF, 0.0)


def _page_read_once(model: MilpModel, graph: TrainingGraph, v: Variables) -> None:
    """A page is read exactly once and written only when the last one was read, for each
    forward node ``i`` and ``t > i``:

        Σ_t page_out[t][i] ≤ Σ_t page_in[t][i]     (every page written is read)
        Σ_{s ≤ t} page_in[s][i] ≤ Σ_{s < t} page_out[s][i]
        Σ_{s ≤ t} page_out[s][i] ≤ Σ_{s < t} page_in[s][i] + 1
    """
    t_count = len(graph)
    p_in, p_out = v.page_in, v.page_out
    for i, node in enumerate(graph.nodes):
        if node.backward:
            continue
        model.row(
            [(p_out[t, i], 1.0) for t in range(i + 1, t_count)]
            + [(p_in[t, i], -1.0) for t in range(i + 1, t_count)],
            -INF,
            0.0,
        )
        for t in range(i + 1, t_count):
            ins = [(p_in[s, i], 1.0) for s in range(t + 1)]
            outs_before = [(p_out[s, i], -1.0) for s in range(t)]
            model.row(ins + outs_before, -INF, 0.0)
            outs = [(p_out[s, i], 1.0) for s in range(t + 1)]
            ins_before = [(p_in[s, i], -1.0) for s in range(t)]
            model.row(outs + ins_before, -INF, 1.0)
