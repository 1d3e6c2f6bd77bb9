"""Tile-parallel training of YOLOv2-16: speed, memory, halo bytes and groupings, side by side.

Measured on this machine, in one run, medians over all timed steps (the first step of every
launch is warm-up and left out):

* speed: one process with one thread (the plain model) against two workers (1x2 grid) with one
  thread each, with the groups optimised for Pi 3 Ethernet and for this machine, in paired
  rounds (the speedup is the median of each round's ratio); also two independent single-thread
  copies of the plain model at once, which is the most two workers could gain here (the
  machine's parallel ceiling); each worker's synchronisation points per step beside the cost
  model's count, and the load average of each round;
* memory: peak tensor bytes per rank of a 2x2 grid against the plain model on one device (exact
  storage counts, not RSS);
* halo bytes: what gloo carried against what the geometry predicts, per rank;
* groupings on 2x2: one group, per layer, and the cost model's optimum;
* image sizes torch floors (200 px, whose fourth pooling drops row 24 of 25, and a 180x240
  frame, 45 -> 22 rows): exact against one process in float64, halo bytes against the geometry;
* the cost model's prediction for Raspberry Pi 3 clusters of 1-6 devices beside the paper's
  reported speedups;
* every built-in CNN tiled end to end (``_tiles_models.py``).

Usage: ``python benchmarks/tiles.py [--image 416] [--steps 4] [--rounds 2] [--sections ...]
[--json]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace
from typing import Any

import torch

from edgetrain.cli.output import console, emit_json, table
from edgetrain.devices import CLUSTERS, Cluster, Device, Link
from edgetrain.models import build
from edgetrain.tiles.check import max_relative_difference, reference
from edgetrain.tiles.grid import (
    Grid,
    Grouping,
    format_grouping,
    parse_grid,
    parse_groups,
    parse_image,
)
from edgetrain.tiles.grouping import (
    grid_for,
    optimise,
    single_core_seconds,
    step_cost,
    sync_points,
)
from edgetrain.tiles.launch import run_local
from edgetrain.tiles.layers import describe
from edgetrain.tiles.tiling import plan
from edgetrain.tiles.worker import RankResult, TileJob
from edgetrain.units import format_bytes

PAPER = {"speedup": "2-15x over one core (2-6 Pi 3)", "memory": "up to 8x less per device"}
TARGETS = {"speedup": {1: 1.5, 4: 1.7}, "memory_ratio": 0.35}
"""Two workers against one process per batch size, and a 2x2 rank's peak against one device."""


def _timed(results: list[RankResult]) -> list[float]:
    """A launch's step times: the slowest rank per step, the first step left out."""
    per_step = zip(*(r.step_seconds for r in results), strict=True)
    return [max(step) for step in per_step][1:]


def _job(
    model: torch.nn.Module, image: int, grid: Grid, grouping: Grouping, batch: int = 1, **kw: Any
) -> TileJob:
    return TileJob(model, (image, image), batch, grid, grouping, **kw)


LOOPBACK = Cluster(
    "loopback",
    Device("one core of this VM (assumed)", 4.3e10, 1, 1.0, 2**33),
    Link("loopback gloo (assumed)", 2e9, 1.5e-3, False),
)
"""This machine as the cost model sees it: one core trains YOLOv2-16 at 416 px, batch 1, in
about 0.43 s (6.1 G MAC forward, backward twice that), and a round of messages between two
loaded processes costs about 1.5 ms. Groupings optimised for it fuse where a Pi 3 would not."""


def speed(
    model: Any, image: int, batch: int, steps: int, rounds: int, groupings: dict[str, Grouping]
) -> dict:
    """Alternate: plain model, each 1x2 grouping, two plain copies at once; the speedup is the
    median over rounds of each round's ratio (paired: drift on a shared machine hits both)."""
    whole: Grouping = ((0, len(model) - 1),)
    solo = _job(
        model, image, Grid(1, 1), whole, batch, steps=steps, reference=True, measure_memory=False
    )
    net = describe(model, 3, image, image)
    names = ["one process", *(f"2 workers, {name}" for name in groupings), "two copies at once"]
    per_round: dict[str, list[float]] = {name: [] for name in names}
    rounds_measured: dict[str, list[int]] = {}
    load = [os.getloadavg()[0]]
    for _ in range(rounds):
        per_round["one process"].append(statistics.median(_timed(run_local([solo], threads=1)[0])))
        for name, grouping in groupings.items():
            tiled = _job(
                model, image, Grid(1, 2), grouping, batch, steps=steps, measure_memory=False
            )
            ranks = run_local([tiled], threads=1)[0]
            per_round[f"2 workers, {name}"].append(statistics.median(_timed(ranks)))
            rounds_measured[name] = [r.sync_points // steps for r in ranks]
        # two independent copies, each pinned to its own core like the two workers
        both = run_local([replace(solo, grid=Grid(1, 2))])[0]
        per_round["two copies at once"].append(statistics.median(_timed(both)))
        load.append(os.getloadavg()[0])
    base = per_round["one process"]
    rows = []
    for name, seconds in per_round.items():
        ratios = [b / t for b, t in zip(base, seconds, strict=True)]
        if name == "two copies at once":
            ratios = [2 * r for r in ratios]
        row: dict[str, Any] = {
            "run": name,
            "step_seconds": statistics.median(seconds),
            "speedup": statistics.median(ratios),
            "speedup_per_round": ratios,
        }
        grouping_name = name.removeprefix("2 workers, ")
        if grouping_name in groupings:
            grouping = groupings[grouping_name]
            row["groups"] = format_grouping(grouping)
            row["sync_points_measured"] = rounds_measured[grouping_name]
            row["sync_points_predicted"] = [
                sync_points(net, Grid(1, 2), grouping, r) for r in (0, 1)
            ]
        rows.append(row)
    return {
        "batch": batch,
        "rows": rows,
        "ceiling": rows[-1]["speedup"],
        "steps_per_run": steps - 1,
        "rounds": rounds,
        "load_average_1min": load,
    }


def memory_and_halos(model: Any, image: int, groupings: dict[str, Grouping]) -> dict:
    """2x2 grid: peak bytes per rank and halo bytes, measured against predicted."""
    whole: Grouping = ((0, len(model) - 1),)
    solo = _job(model, image, Grid(1, 1), whole, steps=2, reference=True)
    one_device = max(r.peak_bytes for r in run_local([solo])[0])
    net = describe(model, 3, image, image)
    rows = []
    jobs = [_job(model, image, Grid(2, 2), g, steps=2) for g in groupings.values()]
    for (name, grouping), ranks in zip(groupings.items(), run_local(jobs), strict=True):
        tiles = plan(net, Grid(2, 2), grouping)
        predicted = [2 * tiles.halo_bytes_sent(r.rank, 1, 4) for r in ranks]
        measured = [r.halo_bytes for r in ranks]
        peak = max(r.peak_bytes for r in ranks)
        rows.append(
            {
                "grouping": name,
                "groups": format_grouping(grouping),
                "peak_bytes_per_rank": peak,
                "ratio_to_one_device": peak / one_device,
                "halo_bytes_measured": measured,
                "halo_bytes_predicted": predicted,
                "halo_bytes_equal": measured == predicted,
                "redundant_compute": tiles.redundant_macs / net.macs(),
                "step_seconds_here": statistics.median(_timed(ranks) or [0.0]),
                "pi3_ethernet_seconds": step_cost(
                    net, Grid(2, 2), grouping, CLUSTERS["pi3-ethernet"]
                ).seconds,
                "pi3_wifi_seconds": step_cost(
                    net, Grid(2, 2), grouping, CLUSTERS["pi3-wifi"]
                ).seconds,
            }
        )
    return {"one_device_peak_bytes": one_device, "rows": rows}


ODD_SIZES = (("200", "3x2"), ("180x240", "2x2"))
"""(image, grid) pairs of the odd-size check: 200 px (the poolings floor it) and a 4:3 frame."""


def odd_sizes(model: Any) -> list[dict]:
    """Sizes torch floors, float64, two steps, optimised groups: the largest relative difference
    from one process, halo bytes measured against predicted, and peak bytes per rank."""
    rows = []
    for image_text, grid_text in ODD_SIZES:
        image, grid = parse_image(image_text), parse_grid(grid_text)
        net = describe(model, 3, *image)
        grouping = optimise(net, grid, CLUSTERS["pi3-ethernet"]).grouping
        job = TileJob(model, image, 1, grid, grouping, steps=2, dtype="float64", collect=True)
        ranks = run_local([job])[0]
        tiles = plan(net, grid, grouping)
        predicted = [job.steps * tiles.halo_bytes_sent(r.rank, 1, 8) for r in ranks]
        measured = [r.halo_bytes for r in ranks]
        rows.append(
            {
                "image": list(image),
                "grid": str(grid),
                "output": list(net.sizes[-1]),
                "groups": format_grouping(grouping),
                "max_rel_diff": max_relative_difference(job, ranks, reference(job)),
                "halo_bytes_measured": measured,
                "halo_bytes_predicted": predicted,
                "halo_bytes_equal": measured == predicted,
                "peak_bytes_per_rank": max(r.peak_bytes for r in ranks),
                "redundant_compute": tiles.redundant_macs / net.macs(),
            }
        )
    return rows


def pi3_predictions(model: Any, image: int = 416) -> list[dict]:
    """Predicted step time and speedup over one Pi 3 core for 1-6 devices, both links.

    Always at the paper's 416 x 416, batch 1, whatever ``--image`` the measurements use.
    """
    net = describe(model, 3, image, image)
    rows = []
    for name, cluster in CLUSTERS.items():
        core = single_core_seconds(net, cluster)
        for devices in range(1, 7):
            grid = grid_for(devices)
            best = optimise(net, grid, cluster)
            rows.append(
                {
                    "profile": name,
                    "devices": devices,
                    "grid": str(grid),
                    "groups": format_grouping(best.grouping),
                    "step_seconds": best.seconds,
                    "speedup_vs_core": core / best.seconds,
                    "speedup_without_weight_sync": core / (best.seconds - best.allreduce_seconds),
                    "one_core_seconds": core,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image", type=int, default=416)
    parser.add_argument("--steps", type=int, default=4, help="steps per launch (first is warm-up)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds of the speed runs"
    )
    parser.add_argument(
        "--batches", default="1,4", help="batch sizes of the speed runs (comma-separated)"
    )
    parser.add_argument(
        "--sections",
        default="speed,memory,odd,pi3,models",
        help="which measurements (comma-separated)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    torch.manual_seed(0)
    model = build("yolov2-16")
    net = describe(model, 3, args.image, args.image)
    auto2 = optimise(net, Grid(1, 2), CLUSTERS["pi3-ethernet"]).grouping
    local2 = optimise(net, Grid(1, 2), LOOPBACK).grouping
    auto4 = optimise(net, Grid(2, 2), CLUSTERS["pi3-ethernet"]).grouping
    n = len(model)
    result: dict[str, Any] = {"image": args.image, "paper": PAPER, "targets": TARGETS}
    if "speed" in sections:
        result["speed"] = [
            speed(
                model,
                args.image,
                int(batch),
                args.steps,
                args.rounds,
                {"optimised (Pi 3 Ethernet)": auto2, "optimised (this machine)": local2},
            )
            for batch in args.batches.split(",")
        ]
    if "memory" in sections:
        result["memory"] = memory_and_halos(
            model,
            args.image,
            {
                "1 group": ((0, n - 1),),
                "per-layer": parse_groups("per-layer", n),
                "optimised": auto4,
            },
        )
    if "odd" in sections:
        result["odd_sizes"] = odd_sizes(model)
    if "pi3" in sections:
        result["pi3"] = pi3_predictions(model)
    if "models" in sections:
        from _tiles_models import graph_models

        result["models"] = graph_models()
    if args.json:
        from _common import measured_on

        emit_json({**result, "measured_on": measured_on()})
    else:
        _print(result)


def _print(result: dict) -> None:
    for s in result.get("speed", []):
        load = ", ".join(f"{x:.1f}" for x in s["load_average_1min"])
        target = TARGETS["speedup"].get(s["batch"], "-")  # type: ignore[attr-defined]
        console.print(
            table(
                f"Speed, yolov2-16 at {result['image']} px, batch {s['batch']}, 1 thread per "
                f"process (medians of {s['rounds']} paired rounds x {s['steps_per_run']} steps)",
                ("run", "step", "speedup over one process", "sync points/step (predicted)",
                 "groups"),
                [
                    (
                        r["run"],
                        f"{r['step_seconds']:.3f} s",
                        f"{r['speedup']:.2f}x",
                        _sync(r),
                        r.get("groups", ""),
                    )
                    for r in s["rows"]
                ],
                caption=(
                    f"target >= {target}x; "
                    f"this machine's ceiling for two processes is {s['ceiling']:.2f}x (two "
                    f"independent copies at once); load average (1 min) per round: {load}"
                ),
            )
        )  # fmt: skip
    if "memory" in result:
        _print_memory(result["memory"])
    if "odd_sizes" in result:
        _print_odd(result["odd_sizes"])
    if "pi3" in result:
        _print_pi3(result["pi3"])
    if "models" in result:
        from _tiles_models import print_models

        print_models(result["models"])


def _sync(row: dict) -> str:
    if "sync_points_measured" not in row:
        return ""
    measured, predicted = row["sync_points_measured"], row["sync_points_predicted"]
    text = "/".join(map(str, measured))
    return text + (" (=)" if measured == predicted else f" ({'/'.join(map(str, predicted))})")


def _print_odd(rows: list[dict]) -> None:
    console.print(
        table(
            "Image sizes torch floors: yolov2-16, float64, 2 steps, optimised groups",
            ("image", "grid", "output", "max_rel_diff", "halo bytes (measured = predicted)",
             "peak/rank", "redundant", "groups"),
            [
                (
                    "x".join(map(str, r["image"])),
                    r["grid"],
                    "x".join(map(str, r["output"])),
                    f"{r['max_rel_diff']:.1e}",
                    f"{format_bytes(sum(r['halo_bytes_measured']))} "
                    f"({'yes' if r['halo_bytes_equal'] else 'NO'})",
                    format_bytes(r["peak_bytes_per_rank"]),
                    f"{100 * r['redundant_compute']:.1f}%",
                    r["groups"],
                )
                for r in rows
            ],
            caption="max_rel_diff: output, input gradient, every weight gradient, weights and "
            "batch-norm statistics against one process; halo bytes summed over ranks",
        )
    )  # fmt: skip


def _print_memory(m: dict) -> None:
    console.print(
        table(
            f"2x2 grid against one device ({format_bytes(m['one_device_peak_bytes'])} peak)",
            ("grouping", "groups", "peak/rank", "ratio", "halo bytes (measured = predicted)",
             "redundant", "step here", "Pi 3 eth", "Pi 3 Wi-Fi"),
            [
                (
                    r["grouping"],
                    r["groups"],
                    format_bytes(r["peak_bytes_per_rank"]),
                    f"{r['ratio_to_one_device']:.3f}",
                    f"{format_bytes(max(r['halo_bytes_measured']))} "
                    f"({'yes' if r['halo_bytes_equal'] else 'NO'})",
                    f"{100 * r['redundant_compute']:.1f}%",
                    f"{r['step_seconds_here']:.2f} s",
                    f"{r['pi3_ethernet_seconds']:.2f} s",
                    f"{r['pi3_wifi_seconds']:.2f} s",
                )
                for r in m["rows"]
            ],
            caption=f"target ratio <= {TARGETS['memory_ratio']}; paper: {PAPER['memory']}",
        )
    )  # fmt: skip


def _print_pi3(pi3: list[dict]) -> None:
    console.print(
        table(
            "Cost model: Raspberry Pi 3 clusters, yolov2-16 at 416 px, batch 1 (optimised groups)",
            ("profile", "devices", "grid", "step", "speedup vs 1 core", "no weight sync", "groups"),
            [
                (
                    r["profile"],
                    str(r["devices"]),
                    r["grid"],
                    f"{r['step_seconds']:.2f} s",
                    f"{r['speedup_vs_core']:.1f}x",
                    f"{r['speedup_without_weight_sync']:.1f}x",
                    r["groups"],
                )
                for r in pi3
            ],
            caption=(
                f"paper: {PAPER['speedup']}; one core: {pi3[0]['one_core_seconds']:.1f} s"
                " per step. 'no weight sync' leaves out the weight-gradient all-reduce, which the"
                " paper's prototype did not perform (its weight update was commented out)."
            ),
        )
    )


if __name__ == "__main__":
    main()
