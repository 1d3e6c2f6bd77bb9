"""Every built-in CNN tiled end to end: exact against one process, halo bytes against the
geometry, peak memory per rank against one process (``benchmarks/tiles.py --sections models``).

Each model runs on a 1x2 grid, float64, batch 2, two steps, at the cut the cost model chooses for
Pi 3 Ethernet and with every map tiled (``last``); one process runs the same steps.
"""

from __future__ import annotations

from typing import Any

import torch

from edgetrain.cli.output import console, table
from edgetrain.devices import CLUSTERS
from edgetrain.models import build
from edgetrain.tiles.check import max_relative_difference, reference
from edgetrain.tiles.front import halo_bytes_sent
from edgetrain.tiles.graph import analyse, choose_cut, front_ops, place
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.launch import run_local
from edgetrain.tiles.worker import TileJob
from edgetrain.units import format_bytes

GRID = Grid(1, 2)
MODELS = (("resnet18-module", 64), ("resnet50-module", 64), ("mobilenetv2", 64), ("unet", 64),
          ("yolov2-16", 67))  # fmt: skip


def graph_models(grid: Grid = GRID, batch: int = 2) -> list[dict[str, Any]]:
    """One row per model and cut (see the module docstring)."""
    rows = []
    for name, image in MODELS:
        torch.manual_seed(0)
        model = build(name).double()
        graph, infos = analyse(model, torch.zeros(batch, 3, image, image, dtype=torch.float64))
        auto = choose_cut(graph, infos, grid, CLUSTERS["pi3-ethernet"])[0]
        for label, placement in (("auto", auto), ("last", place(graph, infos, grid, len(infos)))):
            job = TileJob(model, (image, image), batch, grid, (), steps=2, dtype="float64",
                          collect=True, cut=placement.cut)  # fmt: skip
            ranks = run_local([job])[0]
            ref = reference(job)
            ops = front_ops(infos, placement)
            predicted = [2 * halo_bytes_sent(ops, r.rank) for r in ranks]
            rows.append(
                {
                    "model": name,
                    "image": image,
                    "cut": label,
                    "tiled_operations": sum(op.placement == "tiled" for op in ops),
                    "operations": len(infos),
                    "max_rel_diff": max_relative_difference(job, ranks, ref),
                    "halo_bytes_measured": [r.halo_bytes for r in ranks],
                    "halo_bytes_predicted": predicted,
                    "peak_bytes_per_rank": max(r.peak_bytes for r in ranks),
                    "peak_bytes_one_process": ref.peak_bytes,
                }
            )
    return rows


def print_models(rows: list[dict[str, Any]]) -> None:
    console.print(
        table(
            "Built-in CNNs tiled end to end: 1x2 grid, float64, batch 2, 2 steps",
            ("model", "image", "cut", "tiled ops", "max_rel_diff",
             "halo bytes (measured = predicted)", "peak/rank", "one process"),
            [
                (
                    r["model"], str(r["image"]), r["cut"],
                    f"{r['tiled_operations']}/{r['operations']}",
                    f"{r['max_rel_diff']:.1e}",
                    f"{format_bytes(sum(r['halo_bytes_measured']))} "
                    f"({'yes' if r['halo_bytes_measured'] == r['halo_bytes_predicted'] else 'NO'})",
                    format_bytes(r["peak_bytes_per_rank"]),
                    format_bytes(r["peak_bytes_one_process"]),
                )
                for r in rows
            ],
            caption="max_rel_diff: output, input gradient, every weight gradient, weights and "
            "batch-norm statistics against one process; auto: the cost model's cut for Pi 3 "
            "Ethernet; last: every map with a pixel per tile",
        )
    )  # fmt: skip
