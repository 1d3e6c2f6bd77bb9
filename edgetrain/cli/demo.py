"""``edgetrain demo``: the main job on its embedded default.

1. The paper's Tables I-III recomputed from the models' shapes, every cell beside the paper's.
2. A checkpointed training run of ResNet-18 in less memory than plain autograd needs, with the
   measured peak beside the predicted one.
"""

from __future__ import annotations

import click

from edgetrain import progress
from edgetrain.cli.options import BATCH, POSITIVE, SIZE_HELP, ModelChoice, Size
from edgetrain.cli.output import console, table
from edgetrain.cli.train import run_training
from edgetrain.models import model_chain
from edgetrain.paper.memory_model import PAPER_DEPTHS, paper_cells, paper_estimate, to_mb
from edgetrain.units import format_bytes


@click.command(name="demo")
@click.option("--steps", default=4, show_default=True, type=POSITIVE, help="Training steps.")
@click.option(
    "--memory",
    type=Size(),
    default="420MB",
    show_default=True,
    help=f"Device memory for the ResNet-18 run (plain autograd needs about 490 MiB; {SIZE_HELP}).",
)
@click.option("--batch", default=16, show_default=True, type=BATCH, help="Images per step.")
def demo(steps: int, memory: int, batch: int) -> None:
    """Reproduce the paper's memory tables, then train ResNet-18 within a small budget.

    Models: ResNet-18..152 for the tables, ResNet-18 for the run. The tables are in the paper's
    MB, which is 2^20 bytes (MiB); Table III in its GB (2^30 bytes).
    """
    _check_memory(memory, batch)
    results: dict[tuple[str, int, int, int], tuple[float, float]] = {}
    paper_list = list(paper_cells())
    with progress.task("paper tables I-III", total=len(paper_list)) as step:
        for name, depth, cell_batch, image, paper in paper_list:
            chain = model_chain(f"resnet{depth}", cell_batch, image, timing=False)
            ours = to_mb(paper_estimate(chain).total_bytes)
            results[(name, depth, cell_batch, image)] = (ours, paper)
            step()
    for name, key, label, unit in (
        ("I", "batch", "224x224, by batch, MB (= MiB, 2^20 bytes)", 1.0),
        ("II", "image", "batch 1, by image side, MB (= MiB, 2^20 bytes)", 1.0),
        ("III", "image", "batch 8, by image side, GB (= GiB, 2^30 bytes)", 1024.0),
    ):
        cells = {k: v for k, v in results.items() if k[0] == name}
        columns = sorted({k[2] if key == "batch" else k[3] for k in cells})
        rows = []
        for depth in PAPER_DEPTHS:
            row: list[str] = [f"ResNet-{depth}"]
            for c in columns:
                k = next(
                    k for k in cells if k[1] == depth and (k[2] if key == "batch" else k[3]) == c
                )
                ours, paper = cells[k]
                row.append(f"{ours / unit:.2f} ({100 * (ours / paper - 1):+.1f}%)")
            rows.append(row)
        console.print(
            table(f"Table {name}: {label}; ours (error vs paper)", [key, *map(str, columns)], rows)
        )
    worst = max(results.items(), key=lambda kv: abs(kv[1][0] / kv[1][1] - 1))
    (name, depth, cell_batch, image), (ours, paper) = worst
    console.print(
        f"largest error: Table {name}, ResNet-{depth}, batch {cell_batch}, {image}x{image}: "
        f"{ours:.2f} MiB vs the paper's {paper:.2f} MB (its MB is a MiB) "
        f"({100 * (ours / paper - 1):+.2f}%)\n"
    )
    report = run_training(
        ModelChoice(name="resnet18", file=None, batch=batch, image=224),
        memory,
        None,
        steps,
        "optimal",
        "momentum",
        0.01,
        0,
        progress=True,
    )
    console.print(
        table(
            f"ResNet-18, batch {batch}, 224x224, {steps} steps of SGD+momentum "
            f"in {format_bytes(memory)}",
            ["", "value"],
            [
                ["plain autograd would need", format_bytes(float(report["plain_peak_bytes"]))],
                ["predicted peak (plan)", format_bytes(float(report["predicted_peak_bytes"]))],
                ["measured peak", format_bytes(float(report["measured_peak_bytes"]))],
                ["recompute factor (plan)", f"{float(report['recompute_factor']):.3f}"],
                ["median step time", f"{float(report['step_seconds']):.2f} s"],
                [
                    "loss first -> last",
                    f"{float(report['first_loss']):.3f} -> {float(report['last_loss']):.3f}",
                ],
            ],
        )
    )


def _check_memory(memory: int, batch: int) -> None:
    """Refuse a --memory below ResNet-18's weights, buffers, input and momentum state before
    the tables and the profile."""
    from edgetrain.cli.plan import check_memory

    check_memory(memory, "resnet18", (batch, 3, 224, 224), "momentum")
