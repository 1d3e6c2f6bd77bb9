"""``edgetrain train``: train a model on synthetic data within a memory budget."""

from __future__ import annotations

from dataclasses import asdict

import click
import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from edgetrain.cli.main import register
from edgetrain.cli.options import size
from edgetrain.cli.output import console, emit_json, table
from edgetrain.errors import InvalidInput
from edgetrain.execute import Checkpointed
from edgetrain.memory import OPTIMIZER_STATES
from edgetrain.models import build, canonical_name, check_image
from edgetrain.planners import STRATEGIES
from edgetrain.schedule import Schedule
from edgetrain.training import train
from edgetrain.units import format_bytes


@click.command(name="train")
@click.option("--model", "model_name", default="resnet18", show_default=True)
@click.option("--memory", default=None, help="Device memory for training, e.g. 512MB.")
@click.option("--recompute", type=float, default=None, help="Largest recompute factor instead.")
@click.option("--steps", default=5, show_default=True, type=int)
@click.option("--batch", default=8, show_default=True, type=int)
@click.option("--image", default=224, show_default=True, type=int)
@click.option("--strategy", type=click.Choice(STRATEGIES), default="optimal", show_default=True)
@click.option(
    "--optimizer",
    type=click.Choice(sorted(OPTIMIZER_STATES)),
    default="momentum",
    show_default=True,
)
@click.option("--lr", default=0.01, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--plan",
    "plan_path",
    default=None,
    help="Run this saved plan (from `edgetrain plan --save`) instead of planning.",
)
@click.option("--json", "as_json", is_flag=True)
def train_command(
    model_name: str,
    memory: str | None,
    recompute: float | None,
    steps: int,
    batch: int,
    image: int,
    strategy: str,
    optimizer: str,
    lr: float,
    seed: int,
    plan_path: str | None,
    as_json: bool,
) -> None:
    """Train on random images: profile, plan within the budget, run, and measure the peak."""
    schedule = Schedule.load(plan_path) if plan_path else None
    report = run_training(
        model_name,
        size(memory),
        recompute,
        steps,
        batch,
        image,
        strategy,
        optimizer,
        lr,
        seed,
        progress=not as_json,
        schedule=schedule,
    )
    if as_json:
        emit_json(report)
        return
    console.print(
        table(
            f"{report['model']}: {steps} steps, batch {batch}, {image}x{image}, {strategy}",
            ["", "value"],
            [
                ["plain autograd would need", format_bytes(report["plain_peak_bytes"])],
                ["predicted peak", format_bytes(report["predicted_peak_bytes"])],
                ["measured peak", format_bytes(report["measured_peak_bytes"])],
                ["measured / predicted", f"{report['measured_over_predicted']:.4f}"],
                ["median step time", f"{report['step_seconds']:.3f} s"],
                ["recompute factor (plan)", f"{report['recompute_factor']:.3f}"],
                ["loss first -> last", f"{report['first_loss']:.4f} -> {report['last_loss']:.4f}"],
            ],
            caption="memory: weights, gradients, optimizer state, buffers, input and activations; "
            "measured as live tensor storages on the second step",
        )
    )


def run_training(
    model_name: str,
    memory: int | None,
    recompute: float | None,
    steps: int,
    batch: int,
    image: int,
    strategy: str,
    optimizer: str,
    lr: float,
    seed: int,
    *,
    progress: bool,
    schedule: Schedule | None = None,
) -> dict[str, object]:
    """Build, profile, plan and train; the report as a dict (also used by ``edgetrain demo``)."""
    if steps < 1:
        raise InvalidInput(f"--steps must be at least 1, got {steps}")
    if batch < 1:
        raise InvalidInput(f"--batch must be at least 1, got {batch}")
    name = canonical_name(model_name)
    check_image(name, image, batch)
    torch.manual_seed(seed)
    model = build(name)
    sample = torch.randn(batch, 3, image, image)
    state = OPTIMIZER_STATES[optimizer] * sum(
        p.numel() * p.element_size() for p in model.parameters()
    )
    if name == "yolov2-16":
        raise InvalidInput("yolov2-16 has no classifier head; train a resnet, or use tiles")
    net = Checkpointed(
        model,
        sample,
        memory_budget=memory,
        max_recompute=recompute,
        strategy=strategy,
        reserve_bytes=state,
        schedule=schedule,
    )
    classes = 1000
    if progress:
        with Progress(
            TextColumn("training"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("train", total=steps, loss=float("nan"))
            result = train(
                net,
                tuple(sample.shape),
                classes,
                steps,
                optimizer=optimizer,
                lr=lr,
                seed=seed,
                on_step=lambda s, loss: bar.update(task, completed=s, loss=loss),
            )
    else:
        result = train(
            net, tuple(sample.shape), classes, steps, optimizer=optimizer, lr=lr, seed=seed
        )
    report: dict[str, object] = {
        "model": name,
        "batch": batch,
        "image": image,
        "strategy": strategy,
        **asdict(result),
    }
    report["measured_over_predicted"] = result.measured_peak_bytes / result.predicted_peak_bytes
    return report


register(train_command)
