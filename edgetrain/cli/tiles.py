"""``edgetrain tiles``: train a few steps tile-parallel on local workers and report each rank."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import click

from edgetrain.cli.options import (
    BATCH,
    MAX_IMAGE,
    MODEL_FILE_HELP,
    POSITIVE,
    POSITIVE_FLOAT,
    SIZE_HELP,
    THREADS,
    ModelFile,
    Size,
)
from edgetrain.cli.output import console, emit_json, table
from edgetrain.cli.tiles_boards import boards_report, caption_lines, fit_profile
from edgetrain.devices.catalog import CLUSTERS
from edgetrain.errors import InvalidInput
from edgetrain.tiles.supported import TILE_MODELS
from edgetrain.units import format_bytes

TOLERANCE = {"float64": 1e-10, "float32": 1e-4}
"""Largest relative difference ``--check`` accepts per precision."""


@click.command("tiles")
@click.option(
    "--model",
    default=None,
    help=f"Model to train: {', '.join(TILE_MODELS)} (default yolov2-16).",
)
@click.option("--model-file", type=ModelFile(), default=None, help=MODEL_FILE_HELP)
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
    help="Layer groups of a plain chain (yolov2-16): auto (cost model), per-layer, 1 (one "
    'group) or ranges "0-3,4-7,8-15".',
)
@click.option(
    "--cut",
    "cut_text",
    default="auto",
    show_default=True,
    help="Where the tiled front of any other CNN ends: auto (cost model), last (every map "
    "tiled), or an operation index; past it every rank runs the rest on the gathered map.",
)
@click.option("--steps", type=POSITIVE, default=3, show_default=True, help="Training steps.")
@click.option(
    "--memory",
    type=Size(),
    default=None,
    help="Memory of each board, e.g. 512MB: the grid of the same boards, the groups or the cut "
    f"are chosen so every rank's predicted peak fits ({SIZE_HELP}).",
)
@click.option(
    "--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True
)
@click.option(
    "--device",
    "profile",
    default="pi3-ethernet",
    show_default=True,
    help=f"Cluster profile the cost model plans for: {', '.join(CLUSTERS)}, or a .json file; a "
    "file listing boards that differ sizes each tile by its board's speed and memory.",
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
    help="When a worker dies or hangs, plan the others as the start was planned (grid, tiles, "
    "--memory) and repeat the step (or stop all).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--check", is_flag=True, help="Also run one process and compare (max_rel_diff).")
@click.option("--fault", default=None, hidden=True, help="Testing: die|hang|raise:RANK:STEP.")
def tiles(
    model: str | None,
    model_file: str | None,
    grid_text: str,
    image_text: str,
    batch: int,
    groups: str,
    cut_text: str,
    steps: int,
    memory: int | None,
    dtype: str,
    profile: str,
    address: str,
    timeout: float,
    threads: int,
    seed: int,
    recover: bool,
    as_json: bool,
    check: bool,
    fault: str | None,
) -> None:
    """Train MODEL for a few steps with one local worker per tile (torch.distributed, gloo).

    Trains the models --model lists, at any image size and batch they accept. Prints per rank the
    peak tensor memory, the median step time and the bytes sent, and the layer groups used.
    At most 16 workers run on one machine; they stop when the command is stopped. A worker that
    dies or hangs is dropped: the others re-tile and repeat the step (--no-recover: stop all).
    Across boards use torchrun (docs/tiles.md).
    """
    from edgetrain.devices import load
    from edgetrain.tiles.grid import parse_grid
    from edgetrain.tiles.launch import check_local_workers

    image = _image(image_text)
    grid = parse_grid(grid_text)
    check_local_workers(grid.size, str(grid))
    import torch

    torch.set_num_threads(threads)  # the workers': a kernel's scratch is measured at theirs
    name, network_model = _load_model(model, model_file, seed)
    planner = _Planner(network_model, image, batch, groups, cut_text, load(profile), dtype, memory)
    start = planner.plan(None, grid)
    job = replace(start.job, steps=steps, seed=seed, collect=check, fault=_fault(fault))
    results = _run_job(job, address, threads, timeout, recover, planner)
    final = planner.plans[-1]  # the plan the run finished on: the survivors' after a loss
    doc = _report(name, image, batch, dtype, steps, final, results)
    if len(planner.plans) > 1:
        doc["start"] = _summary(start)
    failed = final.fitted is not None and _budget_report(doc, final.fitted, memory or 0, results)
    failed = boards_report(doc, results, final.boards) or failed
    failed = _check(job, results, dtype, doc, check) or failed
    if as_json:
        emit_json(doc)
    else:
        _print(doc)
    if failed:
        raise click.exceptions.Exit(1)


def _report(
    name: str, image: Any, batch: int, dtype: str, steps: int, final: Any, results: Any
) -> dict[str, Any]:
    """The run's document: the plan it finished on (``final``) and each rank's measurements."""
    plan_doc = dict(final.doc)
    predicted = plan_doc.pop("predicted_halo_bytes")
    recoveries = results[0].recoveries if results else []
    ranks = [
        {
            **r.summary(),
            "tile": [
                r.output_region.top,
                r.output_region.bottom,
                r.output_region.left,
                r.output_region.right,
            ],
            # the steps this rank ran on the final plan's grid (after a loss: from the repeat)
            "predicted_halo_bytes": predicted[r.rank] * len(r.step_seconds),
        }
        for r in results
    ]
    head = {"model": name, "grid": str(final.job.grid), "image": list(image), "batch": batch}
    return {
        **head,
        "dtype": dtype,
        "steps": steps,
        **plan_doc,
        "ranks": ranks,
        "recoveries": recoveries,
    }


def _summary(planned: Any) -> dict[str, Any]:
    """The start's grid and, with a budget or a profile, its ranks' predicted peaks."""
    memory = (
        planned.fitted.ranks if planned.fitted else planned.boards.ranks if planned.boards else ()
    )
    return {
        "grid": planned.job.grid.describe(),
        "predicted_board_peak_bytes": [m.tensor_peak_bytes for m in memory],
        "predicted_board_heap_bytes": [m.peak_bytes for m in memory],
    }


def _fault(text: str | None) -> tuple[str, int, int] | None:
    """``--fault KIND:RANK:STEP`` (testing: a worker that dies, hangs or fails)."""
    if text is None:
        return None
    kind, _, rest = text.partition(":")
    rank, _, step = rest.partition(":")
    if kind not in ("die", "hang", "raise") or not rank.isdigit() or not step.isdigit():
        raise InvalidInput(f"cannot read --fault {text!r}; give die, hang or raise:RANK:STEP")
    return kind, int(rank), int(step)


@dataclass(frozen=True)
class _Planned:
    """One plan of a launch: its job and report, and every rank's predicted memory as ``--memory``
    (``fitted``) or a profile of boards that differ (``boards``) fitted it."""

    job: Any
    doc: dict[str, Any]
    fitted: Any = None
    boards: Any = None


class _Planner:
    """How ``edgetrain tiles`` plans its boards: the grid asked, its groups or cut chosen by the
    cost model, fitted to ``--memory`` (grid, grouping and each rank's recomputation) or to a
    profile's boards (tiles in proportion to their speeds, within their memory). The launcher
    calls it again for the boards that remain when one drops out
    (:data:`~edgetrain.tiles.recovery.Replan`); ``plans`` lists every plan made, in order."""

    def __init__(
        self,
        model: Any,
        image: Any,
        batch: int,
        groups: str,
        cut: str,
        cluster: Any,
        dtype: str,
        memory: int | None,
    ) -> None:
        self.model, self.image, self.batch, self.dtype = model, image, batch, dtype
        self.groups, self.cut, self.cluster, self.memory = groups, cut, cluster, memory
        self.chain = _is_chain(model, cut)
        self.plans: list[_Planned] = []

    def plan(self, boards: tuple[int, ...] | None, grid: Any) -> _Planned:
        """The plan for ``boards`` (the profile's indices, in rank order; None: every board, as
        at the start) on ``grid`` (or, with ``--memory``, the fastest grid of as many boards that
        fits)."""
        cluster = self.cluster if boards is None else self.cluster.of_boards(boards)
        setup = _chain_setup if self.chain else _graph_setup
        args = (
            self.model,
            self.image,
            grid,
            self.batch,
            self.groups,
            self.cut,
            cluster,
            self.dtype,
        )
        if cluster.boards:
            job, doc, fit = fit_profile(*args, setup, self.chain, self.memory, boards)
            planned = _Planned(job, doc, boards=fit)
        elif self.memory is not None:
            fitted = _fit(self.memory, *args)
            planned = _Planned(fitted.candidate.job, fitted.candidate.extra, fitted=fitted)
        else:
            planned = _Planned(*setup(*args))
        self.plans.append(planned)
        return planned

    def __call__(self, boards: tuple[int, ...], grid: Any) -> Any:
        return self.plan(boards, grid).job


def _image(text: str) -> tuple[int, int]:
    from edgetrain.tiles.grid import parse_image

    image = parse_image(text)
    if max(image) > MAX_IMAGE:
        raise InvalidInput(
            f"image {image[0]}x{image[1]} is more than {MAX_IMAGE:,} pixels per side; give at "
            f"most {MAX_IMAGE}"
        )
    return image


def _check(job: Any, results: Any, dtype: str, doc: dict[str, Any], check: bool) -> bool:
    """With ``check``, compares with one process into ``doc``; True on a mismatch."""
    if not check:
        return False
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
    return failed


def _load_model(model: str | None, model_file: str | None, seed: int) -> tuple[str, Any]:
    import torch

    from edgetrain.models import build
    from edgetrain.tiles.supported import tile_model

    if model is not None and model_file is not None:
        raise InvalidInput("give --model or --model-file, not both")
    torch.manual_seed(seed)
    if model_file is not None:
        from edgetrain.models.factory import load_model_file
        from edgetrain.tiles.graphjob import ship_file_model

        user = load_model_file(model_file).model
        ship_file_model(user, model_file)
        return model_file.rpartition("/")[2], user
    name = tile_model(model or "yolov2-16")
    return name, build(name)


def _is_chain(model: Any, cut_text: str) -> bool:
    """A plain chain of windows trains with fused groups unless a cut is asked for."""
    from edgetrain.tiles.layers import describe

    if cut_text != "auto":
        return False
    try:
        describe(model, 3, 64, 64)
    except InvalidInput:
        return False
    return True


def _chain_setup(
    model: Any, image: Any, grid: Any, batch: int, groups: str, cut: str, cluster: Any, dtype: str
) -> tuple[Any, dict[str, Any]]:
    from edgetrain.tiles.grid import format_grouping
    from edgetrain.tiles.grouping import choose_grouping, plan_cost
    from edgetrain.tiles.layers import describe
    from edgetrain.tiles.tiling import plan
    from edgetrain.tiles.worker import TileJob

    element = 8 if dtype == "float64" else 4
    net = describe(model, 3, *image)
    net.check_batch(batch)
    grouping = choose_grouping(groups, net, grid, cluster, batch, element)
    tile_plan = plan(net, grid, grouping)
    cost = plan_cost(tile_plan, cluster, batch, element)
    job = TileJob(model, image, batch, grid, grouping, dtype=dtype)
    return job, {
        "groups": format_grouping(grouping),
        "redundant_compute": tile_plan.redundant_macs / net.macs(),
        "predicted_seconds": {"profile": cluster.name, "step_seconds": cost.seconds},
        "predicted_halo_bytes": [
            tile_plan.halo_bytes_sent(r, batch, element) for r in range(grid.size)
        ],
    }


def _graph_setup(
    model: Any, image: Any, grid: Any, batch: int, groups: str, cut: str, cluster: Any, dtype: str
) -> tuple[Any, dict[str, Any]]:
    import torch

    from edgetrain.tiles.front import front_cost, halo_bytes_sent
    from edgetrain.tiles.graph import analyse, choose_cut, front_ops, gradient_bytes, place
    from edgetrain.tiles.worker import DTYPES, TileJob

    channels = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d)).in_channels
    sample = torch.zeros(batch, channels, *image, dtype=DTYPES[dtype])
    graph, infos = analyse(model.to(DTYPES[dtype]), sample)
    if cut == "auto":
        placement = choose_cut(graph, infos, grid, cluster)[0]
    else:
        index = len(infos) if cut == "last" else _index(cut, len(infos))
        placement = place(graph, infos, grid, index)
    ops = front_ops(infos, placement)
    cost = front_cost(placement.cut, ops, gradient_bytes(model), grid, cluster)
    total = sum(op.macs for op in ops) or 1
    job = TileJob(model, image, batch, grid, (), dtype=dtype, cut=placement.cut)
    return job, {
        "cut": placement.cut,
        "operations": len(infos),
        "replicated_compute": sum(op.macs for op in ops if op.placement == "replicated") / total,
        "predicted_seconds": {"profile": cluster.name, "step_seconds": cost.seconds},
        "predicted_halo_bytes": [halo_bytes_sent(ops, r) for r in range(grid.size)],
    }


def _fit(
    memory: int,
    model: Any,
    image: Any,
    grid: Any,
    batch: int,
    groups: str,
    cut: str,
    cluster: Any,
    dtype: str,
) -> Any:
    """The asked grid, groups or cut if every rank fits ``memory``, else the fastest of the
    other grids of as many boards (and other groupings or cuts) that fits; one line, exit 2,
    when none does."""
    from edgetrain.tiles.budget import Candidate, fit_budget, grids_of

    chain = _is_chain(model, cut)

    def candidate(shape: Any, choice: str) -> Any:
        setup = _chain_setup if chain else _graph_setup
        job, doc = setup(model, image, shape, batch, choice, choice, cluster, dtype)
        where = f"groups {doc['groups']}" if chain else f"cut {doc['cut']}"
        return Candidate(
            job, doc["predicted_seconds"]["step_seconds"], f"grid {shape}, {where}", doc
        )

    asked = groups if chain else cut
    choices = dict.fromkeys([asked, "auto", "per-layer", "1"] if chain else [asked, "auto", "last"])

    def others() -> Any:
        for shape in grids_of(grid.size):
            for choice in choices:
                if (shape, choice) != (grid, asked):
                    try:
                        yield candidate(shape, choice)
                    except InvalidInput:  # more tiles than a map has pixels
                        continue

    from edgetrain.tiles.recompute_fit import fit_recomputing, rank_units

    def units_of(job: Any, rank: int) -> Any:
        return rank_units(job, rank, cluster.device.macs_per_second)

    first = candidate(grid, asked)
    recompute = functools.partial(fit_recomputing, units_of=units_of)
    return fit_budget(first, others, memory, grid.size, format_bytes, recompute)


def _budget_report(doc: dict[str, Any], fitted: Any, memory: int, results: Any) -> bool:
    """Adds each rank's predicted and measured peak (weights included) to ``doc``; True when
    a board went over ``memory``."""
    doc["memory"] = {
        "budget_bytes": memory,
        "chosen": fitted.candidate.label,
        "predicted_peak_bytes": fitted.peak_bytes,
        "predicted_step_seconds": fitted.seconds,
        "recompute": [sorted(fitted.candidate.job.recomputed(r)) for r in range(len(fitted.ranks))],
    }
    from edgetrain.tiles.budget import measured_beside, over_budget

    over = False
    for row, result in zip(doc["ranks"], results, strict=True):
        row.update(measured_beside(fitted.ranks[result.rank], result))
        over = over or over_budget(row, memory)
    return over


def _index(text: str, operations: int) -> int:
    if not text.isdigit() or not 1 <= int(text) <= operations:
        raise InvalidInput(
            f"cannot read --cut {text!r}; give auto, last, or an operation index 1..{operations}"
        )
    return int(text)


def _run_job(
    job: Any, address: str, threads: int, timeout: float, recover: bool, replan: Any
) -> Any:
    from edgetrain.tiles.launch import run_local

    jobs = [job]
    return run_local(
        jobs, address=address, threads=threads, timeout=timeout, recover=recover, replan=replan
    )[0]


def _print(doc: dict[str, Any]) -> None:
    rows = [
        (
            str(r["rank"]),
            "{}:{} x {}:{}".format(*r["tile"]) if r["tile"][1] > r["tile"][0] else "(scores)",
            format_bytes(r["peak_bytes"]),
            f"{r['step_seconds']:.3f} s",
            format_bytes(r["halo_bytes"]),
            format_bytes(r["collective_bytes"]),
            format_bytes(r["bytes_sent"]),
        )
        for r in doc["ranks"]
    ]
    where = (
        f"groups {doc['groups']} · redundant compute {100 * doc['redundant_compute']:.1f}%"
        if "groups" in doc
        else f"tiled front: operations 0-{doc['cut'] - 1} of {doc['operations']} · "
        f"replicated compute {100 * doc['replicated_compute']:.1f}%"
    )
    caption = (
        f"{where} · "
        f"{doc['predicted_seconds']['profile']} would take "
        f"{doc['predicted_seconds']['step_seconds']:.2f} s/step"
    )
    if "memory" in doc:
        caption += _memory_line(doc)
    if "boards" in doc:
        caption += caption_lines(doc)
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


def _memory_line(doc: dict[str, Any]) -> str:
    budget = doc["memory"]["budget_bytes"]
    measured = max(r["board_peak_bytes"] for r in doc["ranks"])
    heaps = [r["board_heap_peak_bytes"] for r in doc["ranks"]]
    heap = max((h for h in heaps if h is not None), default=None)
    verdict = "within" if measured <= budget else "OVER"
    sampled = f", heap {format_bytes(heap)} (sampled)" if heap is not None else ""
    return (
        f"\nmemory per board ({doc['memory']['chosen']}, weights included): predicted "
        f"{format_bytes(doc['memory']['predicted_peak_bytes'])} with the kernels' scratch, "
        f"measured tensors {format_bytes(measured)}{sampled}, {verdict} {format_bytes(budget)}"
    )
