"""U-Net, long skips: the chain DP with skip tensors carried along the chain, or the MILP
(remat-only) on the captured graph? Peak memory against recompute time at a few budgets.

Model: ``edgetrain.models.unet.UNet(base=8, depth=3)``, batch 2, 32x32 (52 operations; every
skip stays alive from the encoder to the decoder). Costs are analytic (FLOP counts at
``NOMINAL_FLOPS``) so that every planner sees the same numbers; nothing is timed. Planners:

* ``DP blocks``: what ``Checkpointed`` does today: the graph cut at ``capture.block_cuts``, each
  stage an ``analytic_chain`` stage whose input and output carry the live skips, and the optimal
  chain DP (``plan(chain, "optimal", memory=b)``); peak and time by ``simulate``.
* ``DP per op``: the same with a cut at every admissible position (one stage per operation).
* ``MILP DAG``: the MILP (remat-only, ``edgetrain`` accounting) on the captured graph itself: one
  forward and one backward node per operation, edges where autograd reads a value, so a skip is
  one node held once (sizes and times from the same per-op chain). A node is one tensor, so it
  cannot tell a checkpoint (``Fn``: the output alone) from a graph (``Fa``: the output and the
  saved input): honouring what a graph retains for every held node is pessimistic (``MILP DAG``),
  ignoring it optimistic (``MILP DAG, no retains``: a held output never keeps its input, and
  rebuilding a graph costs nothing extra); the truth lies between.

Budgets are fractions of the DP's keep-everything peak (``simulate`` of ``store_all``). The MILP's
memory model (the ``edgetrain`` accounting) and ``simulate`` agree on chains to within one
activation (see docs/poet.md); their keep-everything peaks are printed for comparison. Recompute
time = plan time − one forward and one backward of every stage (seconds at NOMINAL_FLOPS).
``python benchmarks/unet_planning.py [--json] [--time-limit 60]``
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import simulate
from edgetrain.devices.energy import EnergyProfile
from edgetrain.errors import InfeasibleBudget
from edgetrain.frontend.profiling import NOMINAL_FLOPS
from edgetrain.planners import plan
from edgetrain.planners.optimal import store_all
from edgetrain.planners.poet import check as poet_check
from edgetrain.planners.poet import graph as graphs
from edgetrain.planners.poet import milp

FRACTIONS = (1.0, 0.8, 0.6, 0.5, 0.4)
# Device seconds = chain seconds: a node's joules are its seconds (1 W), paging never used.
NOMINAL = EnergyProfile(
    name="nominal",
    title="analytic chain speed, 1 W",
    flops_per_second=NOMINAL_FLOPS,
    flops_per_joule=NOMINAL_FLOPS,
    pagein_latency_seconds=1.0,
    pagein_bytes_per_second=1.0,
    pageout_latency_seconds=1.0,
    pageout_bytes_per_second=1.0,
    memory_watts=1.0,
    compute_watts=1.0,
)


def dag_graph(captured: object, fine: Chain) -> graphs.TrainingGraph:
    """The captured U-Net as a training graph: per operation k (stage k of the per-op chain
    ``fine``) a forward node (its own output) and a backward node (gradients of what it reads);
    edges: F(u) -> F(k) for each value k reads, F(k) -> B(k) when the operation saves its
    output, F(u) -> B(k) for each saved input u, B(w) -> B(k) for each reader w of k (the loss
    for the output)."""
    from edgetrain.frontend.fx_capture import Captured, live_values

    assert isinstance(captured, Captured)
    ops = captured.nodes
    n = len(ops)
    if fine.length != n:
        raise SystemExit(f"per-op chain has {fine.length} stages for {n} operations")
    index = {op.name: k for k, op in enumerate(ops)}
    readers: list[list[int]] = [[] for _ in range(n)]
    for k, op in enumerate(ops):
        for name in op.reads:
            if name in index:
                readers[index[name]].append(k)

    def node(name: str, backward: bool, seconds: float, size: float, peak: float) -> graphs.Node:
        flop = seconds * NOMINAL_FLOPS
        return graphs.Node(
            name=name,
            backward=backward,
            compute_seconds=NOMINAL.compute_seconds(flop),
            compute_joules=NOMINAL.compute_joules(flop),
            output_bytes=float(size),
            workspace_bytes=max(0.0, float(peak) - size),
        )

    nodes = []
    for k, (op, stage) in enumerate(zip(ops, fine.stages, strict=True)):
        # A node is one tensor held as a whole: what autograd saves besides inputs and output
        # rides with the output when the output is saved too (a max-pool's indices); otherwise
        # (BatchNorm's statistics: 64-512 bytes) it is left out, see ignored_bytes().
        own = op.bytes + (stage.saved_bytes if stage.saves_output else 0)
        nodes.append(node(f"F{k}:{op.name}", False, stage.forward_seconds, own, 0.0))
    nodes.append(node("loss", True, 0.0, 0.0, 0.0))

    def grad_bytes(k: int) -> float:
        return float(sum(ops[index[v]].bytes for v in ops[k].reads if v in index))

    for k in reversed(range(n)):
        stage = fine.stages[k]
        nodes.append(
            node(
                f"B{k}:{ops[k].name}",
                True,
                stage.backward_seconds,
                grad_bytes(k),
                stage.backward_peak_bytes,
            )
        )

    def bwd(k: int) -> int:
        return 2 * n - k

    edges: list[tuple[int, int]] = [(n - 1, n)]
    retains: list[tuple[int, int]] = []
    for k, op in enumerate(ops):
        stage = fine.stages[k]
        if stage.saves_output:
            edges.append((k, bwd(k)))  # the backward reads the output (and what rides with it)
        for name in op.reads:
            if name in index:
                edges.append((index[name], k))
        if stage.saves_input:
            live_in = live_values(captured, k) if k > 0 else captured.inputs
            picked = (
                [live_in[i] for i in stage.saved_inputs]
                if stage.saved_inputs is not None
                else list(op.reads)
            )
            for name in picked:
                if name in index and name in op.reads:
                    edges.append((index[name], bwd(k)))
                    retains.append((k, index[name]))
        sources = [bwd(w) for w in readers[k]]
        if k == n - 1 or not sources:
            sources.append(n)
        edges += [(s, bwd(k)) for s in sources]
    out_bytes = float(ops[-1].bytes)
    held = [(bwd(n - 1), out_bytes), (bwd(n - 1) + 1, out_bytes)]
    held += [(bwd(k) + 1, float(s.gradient_bytes)) for k, s in enumerate(fine.stages) if k]
    held = [(stage, size) for stage, size in held if size and stage < 2 * n + 1]
    return graphs.TrainingGraph(
        tuple(nodes),
        tuple(sorted(set(edges))),
        "unet-dag",
        NOMINAL.name,
        held=tuple(held),
        retains=tuple(sorted(set(retains))),
    )


def dp_plan(
    fine: Chain, graph: graphs.TrainingGraph, budget: float
) -> dict[str, np.ndarray] | None:
    """The per-op chain DP's plan at ``budget`` as the DAG MILP's matrices (a start for it).

    ``R``: every node once in its own stage; a forward the schedule recomputes between ``B k+1``
    and ``B k`` is recomputed in the stage of ``B k``. ``S_ram``: a value is held entering a stage
    exactly when a later stage reads it before recomputing it, then widened so that a held node
    holds what it ``retains``. The two memory models differ a little, so the DP is asked for 100,
    95 .. 80 % of ``budget`` until its plan fits ``budget`` in the DAG's model; None if none does.
    """
    for share in (1.0, 0.95, 0.9, 0.85, 0.8):
        try:
            schedule = plan(fine, "optimal", memory=share * budget)
        except InfeasibleBudget:
            return None
        matrices = _as_matrices(schedule, fine.length, graph)
        if poet_check.evaluate(graph, matrices, "edgetrain").peak_ram_bytes <= budget:
            return matrices
    return None


def _as_matrices(schedule: Schedule, n: int, graph: graphs.TrainingGraph) -> dict[str, np.ndarray]:
    t_count = len(graph)
    r = np.eye(t_count, dtype=np.int64)
    pending: list[int] = []
    started = False
    for kind, k in schedule:
        if kind is Op.BACKWARD:
            started = True
            for j in pending:
                r[2 * n - k, j] = 1
            pending = []
        elif started and kind.is_forward:
            pending.append(k)
    s_ram = np.zeros((t_count, t_count), dtype=np.int64)
    for i in range(t_count):
        readers = graph.successors(i)
        need = False  # walking back from the end: is i read before it is recomputed?
        for t in range(t_count - 1, i, -1):
            if any(r[t, j] for j in readers):
                need = True
            if r[t, i]:
                need = False  # computed here: earlier stages need not hold it
            elif need:
                s_ram[t, i] = 1
    changed = True
    while changed:  # a held node holds what it retains, from where that was last computed
        changed = False
        for v, u in graph.retains:
            for t in np.flatnonzero(s_ram[:, v] > s_ram[:, u]):
                for back in range(int(t), u, -1):
                    if s_ram[back, u]:
                        break
                    s_ram[back, u] = 1
                    changed = True
                    if r[back - 1, u]:
                        break
    return poet_check.remat_plan(r, s_ram)


def ignored_bytes(fine: Chain) -> int:
    """Saved tensors the DAG leaves out (saved besides inputs by an operation whose output is not
    saved: BatchNorm's batch statistics), in bytes, all operations together."""
    return sum(s.saved_bytes for s in fine.stages if not s.saves_output)


def dp(chain: Chain, budget: float) -> tuple[str, float | None, float | None]:
    """(status, peak bytes, seconds) of the optimal chain DP's plan under ``budget`` bytes."""
    try:
        cost = simulate(chain, plan(chain, "optimal", memory=budget))
    except InfeasibleBudget:
        return "infeasible", None, None
    return "optimal", float(cost.peak_bytes), float(cost.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()

    import torch

    from edgetrain.frontend.fx_capture import all_cuts, block_cuts, capture, segments
    from edgetrain.frontend.profiling import analytic_chain
    from edgetrain.models.unet import UNet

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = UNet(classes=2, base=8, depth=3)
    x = torch.randn(2, 3, 32, 32)
    captured = capture(model, x)
    blocks = analytic_chain(segments(captured, block_cuts(captured)), x)
    fine = analytic_chain(segments(captured, all_cuts(captured)), x)
    dag = dag_graph(captured, fine)
    optimistic = replace(dag, retains=())
    reference = simulate(blocks, store_all(blocks))
    base_seconds = float(reference.seconds)
    keep_all = float(reference.peak_bytes)
    peaks = {
        "DP blocks": keep_all,
        "DP per op": float(simulate(fine, store_all(fine)).peak_bytes),
        "MILP DAG": poet_check.evaluate(dag, poet_check.store_all(dag), "edgetrain").peak_ram_bytes,
    }
    rows = []
    for fraction in FRACTIONS:
        budget = fraction * keep_all
        for name, chain in (("DP blocks", blocks), ("DP per op", fine)):
            status, peak, seconds = dp(chain, budget)
            one_pass = float(simulate(chain, store_all(chain)).seconds)
            rows.append(_row(name, fraction, budget, status, peak, seconds, one_pass, None))
        for name, graph in (("MILP DAG", dag), ("MILP DAG, no retains", optimistic)):
            result = milp.solve(
                graph,
                ram_bytes=budget,
                mode="remat",
                accounting="edgetrain",
                time_limit=args.time_limit,
                find_smallest_ram=False,
                initial_plan=dp_plan(fine, graph, budget),
            )
            ev = result.evaluation
            rows.append(
                _row(
                    name,
                    fraction,
                    budget,
                    result.status,
                    None if ev is None else ev.peak_ram_bytes,
                    None if ev is None else ev.runtime_seconds,
                    graph.compute_seconds,
                    result.gap,
                )
            )
    emit(
        "U-Net (base 8, depth 3, batch 2, 32x32): chain DP with carried skips vs MILP on the DAG",
        list(rows[0]),
        rows,
        args.json,
        extra={
            "operations": len(captured.nodes),
            "block_stages": blocks.length,
            "dag_ignores_saved_bytes": ignored_bytes(fine),
            "keep_everything_peak_MB": {k: round(v / 1e6, 4) for k, v in peaks.items()},
            "one_pass_seconds": {
                "DP blocks": base_seconds,
                "MILP DAG": dag.compute_seconds,
            },
            "time_limit_s": args.time_limit,
        },
    )


def _row(
    planner: str,
    fraction: float,
    budget: float,
    status: str,
    peak: float | None,
    seconds: float | None,
    base: float,
    gap: float | None,
) -> dict[str, object]:
    return {
        "budget_%": round(100 * fraction),
        "budget_MB": budget / 1e6,
        "planner": planner,
        "status": status,
        "peak_MB": None if peak is None else peak / 1e6,
        "recompute_%": None if seconds is None else 100 * (seconds / base - 1),
        "gap_%": None if gap is None else 100 * gap,
    }


if __name__ == "__main__":
    main()
