"""Boards that drop out: kill -9 one of four local workers at random moments, and check each run.

Each run trains the same small CNN (two conv/BatchNorm/ReLU blocks and a pooling, float64) on a
2x2 grid with recovery on, and sends SIGKILL to one worker (a random rank) after a random delay,
drawn from late in an uninterrupted run's start-up (the workers import torch and meet) to its
end. Per run: whether it finished, on how many workers,
the line naming the board that dropped and the step repeated, the largest difference of the final
weights and BatchNorm buffers from an uninterrupted one-process run (target <= 1e-10), and the
worker processes left behind (target 0). A kill that lands after the victim's last step changes
nothing (all four finish); the table says so.

Usage: ``python benchmarks/tiles_recovery.py [--runs 10] [--steps 100] [--seed 0] [--json]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import subprocess
import threading
import time
from typing import Any

import numpy as np
import torch
from _common import emit, measured_on
from torch import nn

from edgetrain.tiles.grid import Grid
from edgetrain.tiles.launch import WorkerFailed, run_local
from edgetrain.tiles.worker import RankResult, TileJob

TOLERANCE = 1e-10


def job(grid: Grid, steps: int) -> TileJob:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        nn.MaxPool2d(2),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
    )
    grouping = ((0, 0), (1, 2))
    return TileJob(
        net, (64, 64), 4, grid, grouping, steps, "float64", collect=True, measure_memory=False
    )


def _workers() -> list[Any]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("edgetrain-tile-")]


def _orphans() -> int:
    """Worker processes of this benchmark still alive anywhere (children or re-parented)."""
    found = subprocess.run(
        ["pgrep", "-f", "multiprocessing.spawn"], capture_output=True, text=True, check=False
    )
    pids = [int(p) for p in found.stdout.split()]
    mine = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if f"EDGETRAIN_BENCH_PARENT={os.getpid()}".encode() in handle.read():
                    mine += 1
        except OSError:
            continue
    return mine


def _difference(state: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(state[k] - v))) if v.size else 0.0 for k, v in reference.items())


def one_run(steps: int, delay: float, victim: int) -> dict[str, Any]:
    box: dict[str, Any] = {}

    def launch() -> None:
        try:
            box["results"] = run_local([job(Grid(2, 2), steps)], timeout=20.0, recover=True)[0]
        except WorkerFailed as exc:
            box["error"] = str(exc)

    thread = threading.Thread(target=launch)
    began = time.monotonic()
    thread.start()
    time.sleep(delay)
    killed_at = None
    for process in _workers():
        if process.name == f"edgetrain-tile-{victim}" and process.pid is not None:
            os.kill(process.pid, signal.SIGKILL)
            killed_at = time.monotonic() - began
    thread.join()
    results: list[RankResult] = box.get("results", [])
    return {
        "kill_after_s": round(killed_at if killed_at is not None else delay, 2),
        "victim": victim,
        "finished": "error" not in box,
        "workers_at_end": len(results),
        "dropped": results[0].recoveries[0] if results and results[0].recoveries else None,
        "error": box.get("error"),
        "seconds": round(time.monotonic() - began, 1),
        "state": results[0].state if results else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ["EDGETRAIN_BENCH_PARENT"] = str(os.getpid())  # inherited: finds orphans
    (solo,) = run_local([job(Grid(1, 1), args.steps)])[0]
    began = time.monotonic()
    uninterrupted = run_local([job(Grid(2, 2), args.steps)])[0]
    span = time.monotonic() - began
    training = sum(uninterrupted[0].step_seconds)
    rng = random.Random(args.seed)
    rows = []
    for index in range(args.runs):
        # from late in the start-up (the workers meet) to the end of an uninterrupted run
        delay = rng.uniform(0.8 * (span - training), span)
        row = one_run(args.steps, delay, rng.randrange(4))
        state = row.pop("state")
        row["max_abs_diff"] = None if state is None else _difference(state, solo.state)
        row["exact"] = row["max_abs_diff"] is not None and row["max_abs_diff"] <= TOLERANCE
        time.sleep(1.0)  # let the killed worker's parent reap it before counting
        row["orphans"] = _orphans()
        row["run"] = index
        rows.append(row)
    extra = {
        "uninterrupted_2x2_max_abs_diff": _difference(uninterrupted[0].state, solo.state),
        "finished": f"{sum(r['finished'] for r in rows)} of {len(rows)}",
        "exact": f"{sum(r['exact'] for r in rows)} of {len(rows)}",
        "orphans": sum(r["orphans"] for r in rows),
        "uninterrupted_run_s": round(span, 1),
        "of_which_training_s": round(training, 1),
        "measured_on": measured_on(),
    }
    columns = (
        "run",
        "victim",
        "kill_after_s",
        "finished",
        "workers_at_end",
        "max_abs_diff",
        "orphans",
        "dropped",
    )
    emit("kill -9 of one of four workers (2x2, float64)", columns, rows, args.json, extra)


if __name__ == "__main__":
    main()
