"""Boards that together train what none can alone: per-board budgets with recomputation per rank.

YOLOv2-16 at 416 px, batch 1, float32. One board: ``edgetrain train --memory B`` (Checkpointed
with the optimal recomputation) for each budget. Four boards: ``edgetrain tiles --grid 2x2
--memory B`` for each budget: the choice (grid, groups, the layers each rank recomputes), every
rank's measured peak against its prediction and the budget, or the refusal line and its exit
status. Per rank: the tensors measured and predicted (equal), and the process heap (tensors,
kernel scratch and what neither holds; ``mallinfo2``, sampled) against the prediction that counts
the kernels' scratch. Targets: every measured peak equals its prediction and stays within the
budget; a budget one board refuses trains on four.

Usage: ``python benchmarks/tiles_budget.py [--budgets 100MB,60MB,45MB] [--steps 2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from _common import emit, measured_on

MODEL = ["--model", "yolov2-16", "--image", "416", "--batch", "1"]


def _edgetrain(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", "from edgetrain.cli.main import main; main()", *args]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def one_board(budget: str) -> dict[str, Any]:
    done = _edgetrain("train", *MODEL, "--optimizer", "sgd", "--steps", "1", "--memory", budget)
    return {
        "boards": 1,
        "budget": budget,
        "exit": done.returncode,
        "result": "trains" if done.returncode == 0 else _last_line(done.stderr),
    }


def four_boards(budget: str, steps: int) -> dict[str, Any]:
    done = _edgetrain(
        "tiles", *MODEL, "--grid", "2x2", "--steps", str(steps), "--memory", budget, "--json"
    )
    row: dict[str, Any] = {"boards": 4, "budget": budget, "exit": done.returncode}
    if done.returncode != 0:
        return {**row, "result": _last_line(done.stderr)}
    doc = json.loads(done.stdout)
    memory = doc["memory"]
    ranks = doc["ranks"]
    measured = [r["board_peak_bytes"] for r in ranks]
    predicted = [r["predicted_board_peak_bytes"] for r in ranks]
    heaps = [r["board_heap_peak_bytes"] for r in ranks]
    heap = max((h for h in heaps if h is not None), default=None)
    return {
        **row,
        "result": memory["chosen"],
        "recompute": memory["recompute"],
        "measured_peak_bytes": measured,
        "predicted_peak_bytes": predicted,
        "kernel_scratch_bytes": [r["kernel_scratch_bytes"] for r in ranks],
        "predicted_heap_bytes": [r["predicted_board_heap_bytes"] for r in ranks],
        "measured_heap_bytes": heaps,
        "measured_peak_mib": round(max(measured) / 2**20, 2),
        "predicted_heap_mib": round(memory["predicted_peak_bytes"] / 2**20, 2),
        "measured_heap_mib": None if heap is None else round(heap / 2**20, 2),
        "measured_equals_predicted": measured == predicted,
        "within_budget": max(*measured, heap or 0) <= memory["budget_bytes"],
        "predicted_step_seconds": memory["predicted_step_seconds"],
        "step_seconds_here": [r["step_seconds"] for r in ranks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="100MB,60MB,45MB")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for budget in args.budgets.split(","):
        rows.append(one_board(budget))
        rows.append(four_boards(budget, args.steps))
    columns = ["boards", "budget", "exit", "measured_peak_mib", "measured_equals_predicted"]
    columns += ["predicted_heap_mib", "measured_heap_mib", "within_budget", "result"]
    title = "YOLOv2-16, 416 px, batch 1, float32: one board against four of the same budget"
    emit(title, columns, rows, args.json, {"measured_on": measured_on()})


if __name__ == "__main__":
    main()
