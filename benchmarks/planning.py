"""Planning speed: Revolve on 100 000 steps, and ``plan(chain, "optimal", ...)`` end to end.

Targets: l = 100 000 planned by Revolve in under a second (issue 3); a 200-stage chain planned
within 0.5 × its plain peak or ρ ≤ 1.5 in ≤ 1 s, ResNet-152's chain (batch 8, 224²) at any budget
in ≤ 0.5 s (issue 7); ResNet-152's captured graph, cut inside its blocks, in ≤ 10 s (issue 9).
Every optimal row is the public ``plan()`` call (table, reconstruction, the simulator's checks).
Medians of several runs.

    python benchmarks/planning.py [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _common import emit

from edgetrain.capture import block_cuts, capture, segments
from edgetrain.chain import Chain, uniform_chain
from edgetrain.models import build
from edgetrain.planners import plan
from edgetrain.planners.optimal import minimum_memory, store_all
from edgetrain.planners.revolve import optimal_forward_steps, revolve_steps
from edgetrain.profile import analytic_chain, model_chain
from edgetrain.schedule import simulate


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


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
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
