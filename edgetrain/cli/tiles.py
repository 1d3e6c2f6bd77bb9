"""``edgetrain tiles``: train a few steps tile-parallel on local workers and report each rank."""

from __future__ import annotations

from typing import Any

import click

from edgetrain.cli.options import BATCH, MAX_IMAGE, POSITIVE, POSITIVE_FLOAT, THREADS
from edgetrain.cli.output import console, emit_json, table
from edgetrain.devices.catalog import CLUSTERS
from edgetrain.errors import InvalidInput
from edgetrain.tiles.supported import CHAIN, TILE_MODELS
from edgetrain.units import format_bytes

TOLERANCE = {"float64": 1e-10, "float32": 1e-4}
"""Largest relative difference ``--check`` accepts per precision."""


@click.command("tiles")
@click.option(
    "--model",
    default="yolov2-16",
    show_default=True,
    help=f"Model to train: {', '.join(TILE_MODELS)} (tiles need {CHAIN}).",
)
@click.option("--grid", "grid_text", default="2x2", show_default=True, help="Tiles: rows x cols.")
@click.option(
    "--image",
    "image_text",
    default="416",
    show_default=True,
    help="Image size in pixels: 416, or height x width (480x640); any size the model accepts.",
)
@click.option("--batch", type=BATCH, default=1, show_default=True, help="Images per step.")
@click.option(
    "--groups",
    default="auto",
    show_default=True,
    help='Layer groups: auto (cost model), per-layer, 1 (one group) or ranges "0-3,4-7,8-15".',
)
@click.option("--steps", type=POSITIVE, default=3, show_default=True, help="Training steps.")
@click.option(
    "--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True
)
@click.option(
    "--device",
    "profile",
    default="pi3-ethernet",
    show_default=True,
    help=f"Cluster profile --groups auto optimises for: {', '.join(CLUSTERS)}, or a .json file.",
)
@click.option("--address", default="127.0.0.1", show_default=True, help="Address workers bind.")
@click.option(
    "--timeout", type=POSITIVE_FLOAT, default=120.0, show_default=True, help="Seconds per op."
)
@click.option(
    "--threads",
    type=THREADS,
    default=1,
    show_default=True,
    help="Threads per worker, at most the machine's cores.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Weights and data seed.")
@click.option(
    "--recover/--no-recover",
    default=True,
    show_default=True,
    help="When a worker dies or hangs, re-tile for the others and repeat the step (or stop all).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--check", is_flag=True, help="Also run one process and compare (max_rel_diff).")
def tiles(
    model: str,
    grid_text: str,
    image_text: str,
    batch: int,
    groups: str,
    steps: int,
    dtype: str,
    profile: str,
    address: str,
    timeout: float,
    threads: int,
    seed: int,
    recover: bool,
    as_json: bool,
    check: bool,
) -> None:
    """Train MODEL for a few steps with one local worker per tile (torch.distributed, gloo).

    Trains the models --model lists, at any image size and batch they accept. Prints per rank the
    peak tensor memory, the median step time and the bytes sent, and the layer groups used.
    At most 16 workers (tiles) run on one machine; they stop when the command is stopped. A
    worker that dies or stops answering is dropped: the others re-tile the model and repeat the
    interrupted step (--no-recover stops them all instead). Across boards use torchrun
    (docs/tiles.md).
    """
    import torch

    from edgetrain.devices import load
    from edgetrain.models import build
    from edgetrain.tiles.grouping import choose_grouping, plan_cost
    from edgetrain.tiles.launch import check_local_workers, run_local
    from edgetrain.tiles.layers import describe
    from edgetrain.tiles.supported import tile_model
    from edgetrain.tiles.tiling import format_grouping, parse_grid, parse_image, plan
    from edgetrain.tiles.worker import TileJob

    image = parse_image(image_text)
    if max(image) > MAX_IMAGE:
        raise InvalidInput(
            f"image {image[0]}x{image[1]} is more than {MAX_IMAGE:,} pixels per side; give at "
            f"most {MAX_IMAGE}"
        )
    grid = parse_grid(grid_text)
    check_local_workers(grid.size, str(grid))
    name = tile_model(model)
    torch.manual_seed(seed)
    network_model = build(name)
    element = 8 if dtype == "float64" else 4
    net = describe(network_model, 3, *image)
    net.check_batch(batch)
    cluster = load(profile)
    grouping = choose_grouping(groups, net, grid, cluster, batch, element)
    tile_plan = plan(net, grid, grouping)
    job = TileJob(network_model, image, batch, grid, grouping, steps, dtype, seed, collect=check)
    results = run_local([job], address=address, threads=threads, timeout=timeout, recover=recover)[
        0
    ]
    recoveries = results[0].recoveries if results else []
    predicted = [tile_plan.halo_bytes_sent(r, batch, element) for r in range(grid.size)]
    cost = plan_cost(tile_plan, cluster, batch, element)
    doc: dict[str, Any] = {
        "model": name,
        "grid": str(grid),
        "image": list(image),
        "batch": batch,
        "dtype": dtype,
        "steps": steps,
        "groups": format_grouping(grouping),
        "redundant_compute": tile_plan.redundant_macs / net.macs(),
        "predicted_seconds": {"profile": cluster.name, "step_seconds": cost.seconds},
        "ranks": [
            {
                **r.summary(),
                "tile": [
                    r.output_region.top,
                    r.output_region.bottom,
                    r.output_region.left,
                    r.output_region.right,
                ],
                "predicted_halo_bytes": None if recoveries else predicted[r.rank] * steps,
            }
            for r in results
        ],
        "recoveries": recoveries,
    }
    failed = False
    if check:
        from edgetrain.tiles.check import max_relative_difference, reference

        diff = max_relative_difference(job, results, reference(job))
        doc["max_rel_diff"] = diff
        doc["tolerance"] = TOLERANCE[dtype]
        failed = not diff <= TOLERANCE[dtype]
        if failed and dtype == "float32":
            doc["hint"] = (
                "float32 runs can split where an activation lies within rounding of a LeakyReLU "
                "kink or a max-pool tie; rerun with --dtype float64 for an exact check"
            )
    if as_json:
        emit_json(doc)
    else:
        _print(doc)
    if failed:
        raise click.exceptions.Exit(1)


def _print(doc: dict[str, Any]) -> None:
    rows = [
        (
            str(r["rank"]),
            "{}:{} x {}:{}".format(*r["tile"]),
            format_bytes(r["peak_bytes"]),
            f"{r['step_seconds']:.3f} s",
            format_bytes(r["halo_bytes"]),
            format_bytes(r["collective_bytes"]),
            format_bytes(r["bytes_sent"]),
        )
        for r in doc["ranks"]
    ]
    caption = (
        f"groups {doc['groups']} · redundant compute {100 * doc['redundant_compute']:.1f}% · "
        f"{doc['predicted_seconds']['profile']} would take "
        f"{doc['predicted_seconds']['step_seconds']:.2f} s/step"
    )
    for line in doc["recoveries"]:
        caption += f"\nrecovered: {line}"
    if "max_rel_diff" in doc:
        verdict = "ok" if doc["max_rel_diff"] <= doc["tolerance"] else "MISMATCH"
        caption += f"\ncheck: max_rel_diff {doc['max_rel_diff']:.2e} ({verdict})"
        if "hint" in doc:
            caption += f"\n{doc['hint']}"
    console.print(
        table(
            f"{doc['model']} on a {doc['grid']} grid, image {'x'.join(map(str, doc['image']))}, "
            f"batch {doc['batch']}, "
            f"{doc['dtype']}, {doc['steps']} steps",
            (
                "rank",
                "tile (rows x cols)",
                "peak memory",
                "step",
                "halo sent",
                "collectives",
                "bytes sent",
            ),
            rows,
            caption=caption,
        )
    )
