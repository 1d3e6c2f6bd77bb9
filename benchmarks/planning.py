"""Planning speed: Revolve on 100 000 steps, and ``plan(chain, "optimal", ...)`` end to end.

Targets: l = 100 000 planned by Revolve in under a second; a 200-stage chain planned
within 0.5 × its plain peak or ρ ≤ 1.5 in ≤ 1 s, ResNet-152's chain (batch 8, 224²) at any budget
in ≤ 0.5 s; ResNet-152's captured graph, cut inside its blocks, in ≤ 10 s.
Every optimal row is the public ``plan()`` call (table, reconstruction, the simulator's checks).
Medians of several runs.

A second table compares the flat DP (``plan(chain, "optimal")``) with the block-options DP
(``plan(chain, "blocks")``) on the analytic chains of captured models cut at every admissible
position (ResNet-152-module at batch 8, 224²; the U-Net and ViT-Tiny at the sizes of
``benchmarks/anymodel.py``), and for ResNet-152 also the flat DP on the chain ``block_cuts`` makes
with 2 cuts inside each block (``plan(chain, "optimal")`` plans a chain of more than 256 stages
over its blocks): least activation memory, the recompute factor ρ at budgets of
0.7, 0.5 and 0.3 × plain autograd's peak, and planning seconds (medians), in the loop that sets
gradients to None.

A third table times the one budget search on the held-out mixed chain of 200 stages (stages
saving all, half or none of their output, half of them not saving their input): a first call of
``plan(chain, "optimal", memory=f × store-all peak)`` for f = 0.9, 0.5, 0.3, and of the smallest
budget (``InfeasibleBudget.smallest`` from a budget of 1 byte), each with the kept frontiers
dropped first; process CPU and wall seconds, medians of rounds run interleaved. The DP's compiled
kernel (:mod:`edgetrain.planners.dp_kernels`) is loaded before the rounds; two more rows time
its first call in a fresh process: with an empty numba cache (the one-off compile a machine pays)
and with the cache that compile left (what every later process pays once).

    python benchmarks/planning.py [--runs 5] [--json] [--only blocks|speed|budget]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _common import emit, interleaved_samples, sample_medians

from edgetrain.core.chain import Chain, Stage, uniform_chain
from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget
from edgetrain.frontend.fx_capture import all_cuts, block_cuts, capture, segments
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.models import build, model_chain, sample_input
from edgetrain.planners import plan
from edgetrain.planners.blocks import block_plan
from edgetrain.planners.optimal import (
    OptimalTable,
    TableMaker,
    fastest,
    least_memory,
    minimum_memory,
    store_all,
)
from edgetrain.planners.revolve import optimal_forward_steps, revolve_steps
from edgetrain.planners.search import forget, frontier


def median_seconds(work: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _captured_chain(name: str) -> Chain:
    """The analytic chain of a captured model, cut as Checkpointed cuts it (batch 8, 224²)."""
    x = torch.empty(8, 3, 224, 224, device="meta")
    with torch.device("meta"):
        model = build(name)
    captured = capture(model, x)
    return analytic_chain(segments(captured, block_cuts(captured)), x)


MiB = 2**20
BLOCK_MODELS = {"resnet152-module": (8, 224), "unet": (4, 128), "vit-tiny": (8, 128)}
FRACTIONS = (0.7, 0.5, 0.3)


FALLBACK_ABOVE = 256
"""Admissible cuts above which the comparison row cuts twice inside each block (the flat DP on
2 cuts per block, against the block DP)."""


def _chains(name: str, batch: int, size: int) -> dict[str, Chain]:
    """The analytic chains of a captured model: cut at every admissible position, and (above
    :data:`FALLBACK_ABOVE` cuts) between blocks and twice inside each."""
    x = sample_input(name, batch, size).to("meta")
    with torch.device("meta"):
        model = build(name, image=size)
    captured = capture(model, x)
    cuts = all_cuts(captured)
    chains = {"all cuts": analytic_chain(segments(captured, cuts), x)}
    if len(cuts) >= FALLBACK_ABOVE:
        fallback = block_cuts(captured, 2, all_up_to=FALLBACK_ABOVE)
        chains["2 cuts per block"] = analytic_chain(segments(captured, fallback), x)
    return chains


def _maker(chain: Chain, planner: str) -> TableMaker:
    return block_plan(chain).maker() if planner == "block DP" else TableMaker(chain)


def block_rows(runs: int) -> list[dict[str, object]]:
    """Flat DP vs block-options DP on captured models' chains. Both through the one budget
    search (:func:`~edgetrain.planners.optimal.fastest`); the block DP's times include finding
    every block's options."""
    rows: list[dict[str, object]] = []
    for name, (batch, size) in BLOCK_MODELS.items():
        for cut, chain in _chains(name, batch, size).items():
            peak = simulate(chain, store_all(chain)).peak_bytes
            planners = ["flat DP", "block DP"] if cut == "all cuts" else ["flat DP"]
            for planner in planners:
                row: dict[str, object] = {
                    "model": f"{name} b{batch} {size}²",
                    "cuts": cut,
                    "planner": planner,
                    "stages": chain.length,
                    "dp_stages": _maker(chain, planner).stages,
                    "plain_MiB": peak / MiB,
                }
                start = time.perf_counter()
                least = least_memory(_maker(chain, planner))
                row["least_s"] = time.perf_counter() - start
                row["least_MiB"] = least / MiB
                for fraction in FRACTIONS:
                    try:
                        schedule = fastest(_maker(chain, planner), fraction * peak)
                    except InfeasibleBudget:
                        row[f"rho@{fraction}"] = None
                        continue
                    cost = simulate(chain, schedule)
                    assert cost.peak_bytes <= fraction * peak
                    row[f"rho@{fraction}"] = cost.recompute_factor
                row["plan_s@0.5"] = median_seconds(
                    lambda c=chain, p=planner, b=0.5 * peak: _try_plan(c, p, b), runs
                )
                rows.append(row)
    return rows


def _try_plan(chain: Chain, planner: str, budget: float) -> None:
    with contextlib.suppress(InfeasibleBudget):
        fastest(_maker(chain, planner), budget)


def mixed_chain(length: int = 200, seed: int = 0) -> Chain:
    """The held-out shape: every stage saves all, half (one of two output tensors) or none of
    its output, half of them do not save their input; sizes in pages of 4 KiB."""
    rng = random.Random(seed)
    page = 4096
    stages = []
    for i in range(length):
        out = rng.randint(1, 64) * page
        saved = rng.randint(0, 32) * page
        kind = rng.choice(("all", "half", "none"))
        stages.append(
            Stage(
                name=f"s{i}",
                output_bytes=out,
                saved_bytes=saved,
                saves_input=rng.random() < 0.5,
                saves_output=kind != "none",
                saved_outputs=(0,) if kind == "half" else None,
                leaf_bytes=(out // 2, out - out // 2) if kind == "half" else (),
                forward_peak_bytes=out + rng.randint(0, 8) * page,
                forward_grad_peak_bytes=out + saved + rng.randint(0, 8) * page,
                backward_peak_bytes=rng.randint(1, 64) * page,
                weight_bytes=page,
                gradient_bytes=page,
                forward_seconds=rng.uniform(0.5, 2.0),
                backward_seconds=rng.uniform(0.5, 3.0),
            )
        )
    return Chain(tuple(stages), input_bytes=64 * page, name=f"mixed{length}")


def _smallest(chain: Chain) -> float:
    try:
        plan(chain, "optimal", memory=1)
    except InfeasibleBudget as exc:
        assert exc.smallest is not None
        return exc.smallest
    return 1.0


def budget_rows(runs: int) -> list[dict[str, object]]:
    """First calls of the budget search on the mixed 200-stage chain (kept frontiers dropped)."""
    chain = mixed_chain()
    peak = simulate(chain, store_all(chain)).peak_bytes

    def cold(work: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            forget()
            return work()

        return run

    steps: dict[str, Callable[[], object]] = {
        f"{f} x store-all": cold(lambda f=f: plan(chain, "optimal", memory=f * peak))
        for f in (0.9, 0.5, 0.3)
    }
    steps["smallest budget"] = cold(lambda: _smallest(chain))
    _first_table()  # the kernel loaded: its one-off costs are the rows of kernel_rows
    samples = interleaved_samples(steps, runs, warmup=0)
    smallest = _smallest(chain)
    rows = []
    for name, budget in (
        *((f"{f} x store-all", f * peak) for f in (0.9, 0.5, 0.3)),
        ("smallest budget", smallest),
    ):
        cost = simulate(chain, plan(chain, "optimal", memory=budget))
        cpu, wall = sample_medians(samples[name])
        rows.append(
            {
                "query": name,
                "budget_MiB": budget / MiB,
                "peak/budget": cost.peak_bytes / budget,
                "rho": cost.recompute_factor,
                "cpu_s": cpu,
                "wall_s": wall,
                "target_s": 1.0,
            }
        )
    rows.append({"query": "frontier points", "budget_MiB": len(frontier(chain).points)})
    return rows + kernel_rows()


def _first_table() -> None:
    """A first (small) table and plan: compiles or loads the DP's kernel."""
    chain = uniform_chain(4, activation_bytes=4, forward_seconds=1.0, backward_seconds=2.0)
    OptimalTable(chain, 4.0, 20).schedule(10)


_KERNEL_PROBE = """
import json, time
from edgetrain.core.chain import uniform_chain
from edgetrain.planners.optimal import OptimalTable
chain = uniform_chain(4, activation_bytes=4, forward_seconds=1.0, backward_seconds=2.0)
cpu, wall = time.process_time(), time.perf_counter()
OptimalTable(chain, 4.0, 20).schedule(10)  # as _first_table
print(json.dumps([time.process_time() - cpu, time.perf_counter() - wall]))
"""


def kernel_rows() -> list[dict[str, object]]:
    """The first table of a fresh process, with an empty numba cache, then with the one it
    left (CPU and wall seconds of that call alone, imports not included)."""
    root = Path(__file__).resolve().parent.parent
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(root)}
        for name in ("kernel compile (empty cache)", "kernel load (cached)"):
            probe = [sys.executable, "-c", _KERNEL_PROBE]
            done = subprocess.run(probe, env=env, cwd=root, capture_output=True, check=True)
            cpu, wall = json.loads(done.stdout.decode().splitlines()[-1])
            rows.append({"query": name, "cpu_s": cpu, "wall_s": wall})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", choices=("blocks", "speed", "budget"), default=None)
    args = parser.parse_args()
    if args.only in (None, "budget"):
        emit(
            "The budget search on the mixed 200-stage chain: first calls (medians of "
            f"{args.runs} interleaved rounds; target 1 s)",
            ["query", "budget_MiB", "peak/budget", "rho", "cpu_s", "wall_s", "target_s"],
            budget_rows(args.runs),
            args.json,
        )
    if args.only == "budget":
        return
    if args.only != "speed":
        emit(
            "Flat DP vs block-options DP on captured models (activation MiB; rho at budgets "
            "of 0.7/0.5/0.3 x plain peak; '-': does not fit)",
            [
                "model",
                "cuts",
                "planner",
                "stages",
                "dp_stages",
                "plain_MiB",
                "least_MiB",
                *(f"rho@{f}" for f in FRACTIONS),
                "least_s",
                "plan_s@0.5",
            ],
            block_rows(max(1, args.runs // 2)),
            args.json,
        )
    if args.only == "blocks":
        return
    rows = []
    for slots in (5, 10, 20, 50):
        schedule = revolve_steps(100_000, slots)
        rows.append(
            {
                "planner": f"revolve, 100000 steps, {slots} slots",
                "median_s": median_seconds(lambda s=slots: revolve_steps(100_000, s), args.runs),
                "operations": len(schedule),
                "forward_steps": schedule.forward_steps,
                "optimum p(l,s)": optimal_forward_steps(100_000, slots),
            }
        )
    long = uniform_chain(200, activation_bytes=4096, forward_seconds=1.0, backward_seconds=2.0)
    long_peak = simulate(long, store_all(long)).peak_bytes
    for label, budget in (
        ("0.5 x plain peak", {"memory": 0.5 * long_peak}),
        ("recompute 1.5", {"recompute": 1.5}),
    ):
        rows.append(
            {
                "planner": f"optimal, 200-stage chain, {label}",
                "median_s": median_seconds(lambda b=budget: plan(long, "optimal", **b), args.runs),
                "target_s": 1.0,
            }
        )
    chain = model_chain("resnet152", 8, 224)
    peak = simulate(chain, store_all(chain)).peak_bytes
    smallest = minimum_memory(chain)
    for fraction in (0.0, 0.3, 0.6, 0.9):
        budget = smallest + fraction * (peak - smallest)
        rows.append(
            {
                "planner": f"optimal, ResNet-152 ({chain.length} stages), "
                f"{budget / peak:.0%} of plain memory",
                "median_s": median_seconds(
                    lambda b=budget: plan(chain, "optimal", memory=b), args.runs
                ),
                "target_s": 0.5,
            }
        )
    graph = _captured_chain("resnet152-module")
    graph_peak = simulate(graph, store_all(graph)).peak_bytes
    rows.append(
        {
            "planner": f"optimal, ResNet-152 captured, cut inside blocks ({graph.length} stages), "
            "50% of plain memory",
            "median_s": median_seconds(
                lambda: plan(graph, "optimal", memory=0.5 * graph_peak), max(1, args.runs // 2)
            ),
            "target_s": 10.0,
        }
    )
    emit(
        "Planning speed (target: under 1 s each)",
        ["planner", "median_s", "target_s", "operations", "forward_steps", "optimum p(l,s)"],
        rows,
        args.json,
    )


if __name__ == "__main__":
    main()
