"""``edgetrain memory``: the memory a training step needs, per model, batch and image size."""

from __future__ import annotations

from typing import Any

import click

from edgetrain.cli.main import register
from edgetrain.cli.options import int_list, name_list, size
from edgetrain.cli.output import console, emit_json, table
from edgetrain.memory import (
    OPTIMIZER_STATES,
    autograd_estimate,
    paper_estimate,
    paper_value_mb,
    to_mb,
)
from edgetrain.models import canonical_name, check_image
from edgetrain.profile import model_chain
from edgetrain.units import format_bytes


@click.command()
@click.option(
    "--models",
    default="resnet18,resnet34,resnet50,resnet101,resnet152",
    show_default=True,
    help="Comma-separated model names.",
)
@click.option("--batch", default="1,3,5,10,30,50", show_default=True, help="Batch sizes.")
@click.option("--image", default="224", show_default=True, help="Square image sides (pixels).")
@click.option(
    "--device-memory",
    default="2GiB",
    show_default=True,
    help="Device memory; cells above it are marked (the paper's 2 GB Waggle node).",
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
    default="3GiB",
    show_default=True,
    help="Measure only cells whose autograd prediction is below this.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def memory(
    models: str,
    batch: str,
    image: str,
    device_memory: str,
    optimizer: str,
    measure: bool,
    measure_limit: str,
    as_json: bool,
) -> None:
    """Memory to train each model (the paper's Tables I-III, and what autograd really holds).

    total_mb is the paper's accounting: 4 x weights (weights, gradients, two Adam buffers) plus
    2 x batch x layer outputs (activations and their gradients). autograd_mb is what PyTorch
    holds at the peak of a plain step on this kind of device.
    """
    names = [canonical_name(n) for n in name_list(models)]
    batches = int_list(batch, "batch")
    images = int_list(image, "image")
    for name in names:
        for side in images:
            for b in batches:
                check_image(name, side, b)
    device = size(device_memory)
    limit = size(measure_limit)
    assert device is not None and limit is not None
    rows: list[dict[str, Any]] = []
    for name in names:
        for side in images:
            for b in batches:
                rows.append(_row(name, b, side, device, optimizer, measure, limit))
    if as_json:
        emit_json({"unit": "MB", "device_memory_mb": round(to_mb(device), 2), "rows": rows})
        return
    columns = [
        "model",
        "batch",
        "image",
        "fixed MB",
        "activations MB",
        "total MB",
        "paper MB",
        "error",
        "autograd MB",
    ]
    if measure:
        columns.append("measured MB")
    shown = []
    for r in rows:
        style = "[bold red]" if not r["fits"] else ""
        cells = [
            r["model"],
            r["batch"],
            r["image"],
            f"{r['weights_mb'] + r['gradients_mb'] + r['optimizer_mb']:.2f}",
            f"{r['activations_mb'] + r['activation_gradients_mb']:.2f}",
            f"{style}{r['total_mb']:.2f}",
            "" if r["paper_mb"] is None else f"{r['paper_mb']:.2f}",
            "" if r["paper_mb"] is None else f"{r['error_percent']:+.2f}%",
            f"{r['autograd_total_mb']:.2f}",
        ]
        if measure:
            cells.append("" if r.get("measured_mb") is None else f"{r['measured_mb']:.2f}")
        shown.append(cells)
    console.print(
        table(
            "Memory to train (MB = 2^20 bytes)",
            columns,
            shown,
            caption=f"red: above the device memory ({format_bytes(device)}); fixed: weights, "
            "gradients, 2 Adam buffers; activations: layer outputs and their gradients; "
            "total: paper accounting; autograd: plain PyTorch step with "
            f"{optimizer} on this device"
            + ("; measured: live tensor storages at the step's peak" if measure else ""),
        )
    )


def _row(
    name: str, batch: int, image: int, device: int, optimizer: str, measure: bool, limit: int
) -> dict[str, Any]:
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
        "total_mb": round(total, 2),
        "weights_mb": round(to_mb(paper.weights_bytes), 2),
        "gradients_mb": round(to_mb(paper.gradients_bytes), 2),
        "optimizer_mb": round(to_mb(paper.optimizer_bytes), 2),
        "activations_mb": round(to_mb(paper.activations_bytes), 2),
        "activation_gradients_mb": round(to_mb(paper.activation_gradients_bytes), 2),
        "paper_mb": reference,
        "error_percent": None if reference is None else round(100 * (total / reference - 1), 2),
        "fits": paper.total_bytes <= device,
        "autograd_total_mb": round(to_mb(real.total_bytes), 2),
    }
    if measure:
        measured = None
        if real.total_bytes <= limit:
            from edgetrain.measure_step import measure_training_step

            measured = round(to_mb(measure_training_step(name, batch, image, optimizer)), 2)
        row["measured_mb"] = measured
    return row


register(memory)
