"""``edgetrain train``: train a model on synthetic data within a memory budget."""

from __future__ import annotations

import contextlib
from dataclasses import asdict

import click
import torch

from edgetrain import progress as progress_api
from edgetrain.cli.main import register
from edgetrain.cli.options import (
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_FLOAT,
    RECOMPUTE,
    SIZE_HELP,
    InputFile,
    ModelName,
    Size,
    resnet_names,
)
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
@click.option(
    "--model",
    "model_name",
    type=ModelName(resnet_names(), reason="it has no classifier head; use tiles"),
    default="resnet18",
    show_default=True,
    help="Model to train (the ResNets: they have a classifier head).",
)
@click.option(
    "--memory",
    type=Size(),
    default=None,
    help=f"Device memory for training, e.g. 512MB or 0.5GiB ({SIZE_HELP}).",
)
@click.option(
    "--recompute",
    type=RECOMPUTE,
    default=None,
    help="Largest recompute factor (at least 1) instead of --memory.",
)
@click.option("--steps", type=POSITIVE, default=5, show_default=True, help="Training steps.")
@click.option("--batch", type=POSITIVE, default=8, show_default=True, help="Images per step.")
@click.option("--image", type=POSITIVE, default=224, show_default=True, help="Image side (px).")
@click.option("--strategy", type=click.Choice(STRATEGIES), default="optimal", show_default=True)
@click.option(
    "--optimizer",
    type=click.Choice(sorted(OPTIMIZER_STATES)),
    default="momentum",
    show_default=True,
)
@click.option(
    "--lr", type=POSITIVE_FLOAT, default=0.01, show_default=True, help="Learning rate (> 0)."
)
@click.option("--seed", type=NON_NEGATIVE, default=0, show_default=True)
@click.option(
    "--plan",
    "plan_path",
    type=InputFile(),
    default=None,
    help="Run this saved plan (from `edgetrain plan --save`) instead of planning.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (sizes in bytes) instead.")
def train_command(
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
    plan_path: str | None,
    as_json: bool,
) -> None:
    """Train on random images: profile, plan within the budget, run, and measure the peak.

    Sizes are printed in MiB/GiB (2^20/2^30 bytes). Progress goes to stderr.
    """
    if memory is not None and recompute is not None:
        raise InvalidInput("give --memory or --recompute, not both")
    schedule = Schedule.load(plan_path) if plan_path else None
    report = run_training(
        model_name,
        memory,
        recompute,
        steps,
        batch,
        image,
        strategy,
        optimizer,
        lr,
        seed,
        progress=True,
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
            "measured as live tensor storages on the second step; MiB = 2^20 bytes",
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
    """Build, profile, plan and train; the report as a dict (also used by ``edgetrain demo``).

    ``progress``: show progress on stderr (building, profiling, each step with its loss).
    """
    if steps < 1:
        raise InvalidInput(f"--steps must be at least 1, got {steps}")
    if batch < 1:
        raise InvalidInput(f"--batch must be at least 1, got {batch}")
    if lr <= 0:
        raise InvalidInput(f"--lr must be above 0, got {lr}; e.g. --lr 0.01")
    name = canonical_name(model_name)
    if not name.startswith("resnet"):
        raise InvalidInput(f"{name} has no classifier head; train a resnet, or use tiles")
    check_image(name, image, batch)
    with contextlib.ExitStack() as stack:
        if not progress:
            stack.enter_context(progress_api.quiet())
        progress_api.note(
            f"building {name} and profiling it on this machine (batch {batch}, {image}x{image})"
        )
        torch.manual_seed(seed)
        model = build(name)
        sample = torch.randn(batch, 3, image, image)
        state = OPTIMIZER_STATES[optimizer] * sum(
            p.numel() * p.element_size() for p in model.parameters()
        )
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
        with progress_api.task(f"training {name}", total=steps) as step:
            result = train(
                net,
                tuple(sample.shape),
                classes,
                steps,
                optimizer=optimizer,
                lr=lr,
                seed=seed,
                on_step=lambda _done, loss: step(detail=f"loss {loss:.4f}"),
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
