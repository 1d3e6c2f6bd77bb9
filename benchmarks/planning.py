"""Planning speed: Revolve on 100 000 steps, and the optimal dynamic program on ResNet-152.

Targets (issue 3): l = 100 000 planned by Revolve in under a second; a ResNet-152 chain at 500
memory slots planned by the optimal dynamic program in under a second. Medians of several runs.

    python benchmarks/planning.py [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit

from edgetrain.planners.optimal import OptimalTable, store_all
from edgetrain.planners.revolve import optimal_forward_steps, revolve_steps
from edgetrain.profile import model_chain
from edgetrain.schedule import simulate


def median_seconds(work: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


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
    chain = model_chain("resnet152", 8, 224)
    peak = simulate(chain, store_all(chain)).peak_bytes
    for fraction in (0.3, 0.6):
        budget = fraction * peak

        def solve(b: float = budget) -> None:
            OptimalTable(chain, b / 500, 500).schedule(500)

        rows.append(
            {
                "planner": f"optimal DP, ResNet-152 ({chain.length} stages), 500 slots, "
                f"{fraction:.0%} of plain memory",
                "median_s": median_seconds(solve, args.runs),
            }
        )
    emit(
        "Planning speed (target: under 1 s each)",
        ["planner", "median_s", "operations", "forward_steps", "optimum p(l,s)"],
        rows,
        args.json,
    )


if __name__ == "__main__":
    main()
