"""``edgetrain memory``: the memory a training step needs, per model, batch and image size."""

from __future__ import annotations

from typing import Any

import click

from edgetrain import progress
from edgetrain.cli.options import (
    MAX_BATCH,
    MAX_IMAGE,
    SIZE_HELP,
    IntList,
    ModelList,
    Size,
    model_names,
)
from edgetrain.cli.output import console, emit_json, table
from edgetrain.core.accounting import OPTIMIZER_STATES
from edgetrain.models import check_image, model_chain
from edgetrain.paper.memory_model import autograd_estimate, paper_estimate, paper_value_mb, to_mb
from edgetrain.units import format_bytes, mib


@click.command()
@click.option(
    "--models",
    type=ModelList(),
    default="resnet18,resnet34,resnet50,resnet101,resnet152",
    show_default=True,
    help=f"Comma-separated models among {', '.join(model_names())} (the paper's values exist "
    "for the ResNets).",
)
@click.option(
    "--batch",
    type=IntList("batch", maximum=MAX_BATCH),
    default="1,3,5,10,30,50",
    show_default=True,
    help="Batches.",
)
@click.option(
    "--image",
    type=IntList("image", maximum=MAX_IMAGE),
    default="224",
    show_default=True,
    help="Square image sides (pixels).",
)
@click.option(
    "--memory",
    "device_memory",
    type=Size(),
    default="2GiB",
    show_default=True,
    help=f"Device memory; cells above it are marked (the paper's 2 GB Waggle node; {SIZE_HELP}).",
)
@click.option(
    "--optimizer",
    type=click.Choice(sorted(OPTIMIZER_STATES)),
    default="adam",
    show_default=True,
    help="Optimizer state in the autograd accounting.",
)
@click.option(
    "--measure",
    is_flag=True,
    help="Also run a real forward+backward for cells that fit this machine.",
)
@click.option(
    "--measure-limit",
    type=Size(),
    default="3GiB",
    show_default=True,
    help="Measure only cells whose autograd prediction is below this.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (sizes in bytes) instead.")
def memory(
    models: list[str],
    batch: list[int],
    image: list[int],
    device_memory: int,
    optimizer: str,
    measure: bool,
    measure_limit: int,
    as_json: bool,
) -> None:
    """Memory to train each model (the paper's Tables I-III, and what autograd really holds).

    total is the paper's accounting: 4 x weights (weights, gradients, two Adam buffers) plus
    2 x batch x layer outputs (activations and their gradients). autograd is what PyTorch
    holds at the peak of a plain step on this kind of device. The table is in MiB (2^20 bytes,
    which is what the paper's tables call MB); --json gives bytes.
    """
    for name in models:
        for side in image:
            for b in batch:
                check_image(name, side, b)
    cells = [(name, side, b) for name in models for side in image for b in batch]
    rows: list[dict[str, Any]] = []
    with progress.task("memory table", total=len(cells)) as step:
        for name, side, b in cells:
            rows.append(_row(name, b, side, device_memory, optimizer, measure, measure_limit))
            step(detail=f"{name}, batch {b}, {side}x{side}")
    if as_json:
        emit_json({"device_memory_bytes": device_memory, "rows": rows})
        return
    columns = [
        "model",
        "batch",
        "image",
        "fixed MiB",
        "activations MiB",
        "total MiB",
        "paper MB (MiB)",
        "error",
        "autograd MiB",
    ]
    if measure:
        columns.append("measured MiB")
    shown = []
    for r in rows:
        style = "[bold red]" if not r["fits"] else ""
        cells_shown = [
            r["model"],
            r["batch"],
            r["image"],
            f"{mib(r['weights_bytes'] + r['gradients_bytes'] + r['optimizer_bytes']):.2f}",
            f"{mib(r['activations_bytes'] + r['activation_gradients_bytes']):.2f}",
            f"{style}{mib(r['total_bytes']):.2f}",
            "" if r["paper_mib"] is None else f"{r['paper_mib']:.2f}",
            "" if r["paper_mib"] is None else f"{r['error_percent']:+.2f}%",
            f"{mib(r['autograd_total_bytes']):.2f}",
        ]
        if measure:
            measured = r.get("measured_bytes")
            cells_shown.append("" if measured is None else f"{mib(measured):.2f}")
        shown.append(cells_shown)
    console.print(
        table(
            "Memory to train (MiB = 2^20 bytes; the paper's MB is the same unit)",
            columns,
            shown,
            caption=f"red: above the device memory ({format_bytes(device_memory)}); fixed: "
            "weights, gradients, 2 Adam buffers; activations: layer outputs and their gradients; "
            "total: paper accounting; autograd: plain PyTorch step with "
            f"{optimizer} on this device"
            + ("; measured: live tensor storages at the step's peak" if measure else ""),
        )
    )


def _row(
    name: str, batch: int, image: int, device: int, optimizer: str, measure: bool, limit: int
) -> dict[str, Any]:
    """One cell: every size in bytes; ``paper_mib`` is the paper's value in its MB (= MiB)."""
    chain = model_chain(name, batch, image, timing=False)
    paper = paper_estimate(chain)
    real = autograd_estimate(chain, optimizer)
    depth = int(name.removeprefix("resnet")) if name.startswith("resnet") else 0
    reference = paper_value_mb(depth, batch, image)
    total = to_mb(paper.total_bytes)
    row: dict[str, Any] = {
        "model": name,
        "batch": batch,
        "image": image,
        "total_bytes": paper.total_bytes,
        "weights_bytes": paper.weights_bytes,
        "gradients_bytes": paper.gradients_bytes,
        "optimizer_bytes": paper.optimizer_bytes,
        "activations_bytes": paper.activations_bytes,
        "activation_gradients_bytes": paper.activation_gradients_bytes,
        "paper_mib": reference,
        "error_percent": None if reference is None else round(100 * (total / reference - 1), 2),
        "fits": paper.total_bytes <= device,
        "autograd_total_bytes": real.total_bytes,
    }
    if measure:
        measured = None
        if real.total_bytes <= limit:
            from edgetrain.paper.measured_step import measure_training_step

            measured = int(measure_training_step(name, batch, image, optimizer))
        row["measured_bytes"] = measured
    return row
