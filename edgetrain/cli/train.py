"""``edgetrain train``: train a model (registered, or the user's own) on synthetic data within a
memory budget, and report the measured peak beside the predicted one."""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import asdict
from typing import Any

import click
import torch

from edgetrain import progress as progress_api
from edgetrain.cli.options import (
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_FLOAT,
    RECOMPUTE,
    SIZE_HELP,
    InputFile,
    ModelChoice,
    Size,
    choose_model,
    input_words,
    model_options,
)
from edgetrain.cli.output import console, emit_json, table
from edgetrain.core.accounting import OPTIMIZER_STATES
from edgetrain.core.schedule import Schedule
from edgetrain.errors import InvalidInput
from edgetrain.frontend.cuts import as_stages
from edgetrain.models import MODELS, build, sample_input
from edgetrain.models.factory import load_model_file
from edgetrain.planners import FRONTIER_STRATEGIES
from edgetrain.runtime.checkpointed import Checkpointed
from edgetrain.runtime.checks import check_plan_for
from edgetrain.runtime.training import train
from edgetrain.units import format_bytes


@click.command(name="train")
@model_options(default="resnet18", what="to train")
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
@click.option(
    "--strategy", type=click.Choice(FRONTIER_STRATEGIES), default="optimal", show_default=True
)
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
    model_name: str | None,
    model_file: str | None,
    input_shape: tuple[int, ...] | None,
    batch: int,
    image: int,
    memory: int | None,
    recompute: float | None,
    steps: int,
    strategy: str,
    optimizer: str,
    lr: float,
    seed: int,
    plan_path: str | None,
    as_json: bool,
) -> None:
    """Train on synthetic data: profile, plan within the budget, run, and measure the peak.

    Any registered model or your own (--model-file); one with a forward() is captured with
    torch.fx and cut into stages as `edgetrain plan` shows. The data is the input batch (random,
    from --seed) and a random target: cross-entropy against class labels for a (batch, classes)
    output, mean squared error against a random tensor of the output's shape otherwise (the
    loss's own memory comes on top of the prediction). Sizes are printed in MiB/GiB (2^20/2^30
    bytes). Progress goes to stderr.
    """
    if memory is not None and recompute is not None:
        raise InvalidInput("give --memory or --recompute, not both")
    choice = choose_model(model_name, model_file, input_shape, batch, image, default="resnet18")
    schedule = Schedule.load(plan_path) if plan_path else None
    report = run_training(
        choice,
        memory,
        recompute,
        steps,
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
    shape = tuple(report["input_shape"])  # type: ignore[arg-type]
    console.print(
        table(
            f"{report['model']}: {steps} steps, {input_words(shape)}, {strategy}",
            ["", "value"],
            [
                ["stages", str(report["stages"])],
                ["a step runs as", str(report["runs_as"])],
                ["plain autograd would need", format_bytes(report["plain_peak_bytes"])],
                ["predicted peak", format_bytes(report["predicted_peak_bytes"])],
                ["measured peak", format_bytes(report["measured_peak_bytes"])],
                ["measured / predicted", f"{report['measured_over_predicted']:.4f}"],
                ["median step time", f"{report['step_seconds']:.3f} s"],
                ["recompute factor (plan)", f"{report['recompute_factor']:.3f}"],
                [
                    f"loss ({report['loss']}) first -> last",
                    f"{report['first_loss']:.4f} -> {report['last_loss']:.4f}",
                ],
            ],
            caption="memory: weights, gradients, optimizer state, buffers, input and activations; "
            "measured as live tensor storages on the second step; MiB = 2^20 bytes",
        )
    )


def run_training(
    choice: ModelChoice,
    memory: int | None,
    recompute: float | None,
    steps: int,
    strategy: str,
    optimizer: str,
    lr: float,
    seed: int,
    *,
    progress: bool,
    schedule: Schedule | None = None,
) -> dict[str, Any]:
    """Build, profile, plan and train; the report as a dict (also used by ``edgetrain demo``).

    ``progress``: show progress on stderr (building, profiling, each step with its loss).
    """
    if steps < 1:
        raise InvalidInput(f"--steps must be at least 1, got {steps}")
    if lr <= 0:
        raise InvalidInput(f"--lr must be above 0, got {lr}; e.g. --lr 0.01")
    _check_input_fits(choice)
    with contextlib.ExitStack() as stack:
        if not progress:
            stack.enter_context(progress_api.quiet())
        torch.manual_seed(seed)
        if choice.name is not None:
            _check_on_meta(choice, memory, optimizer, schedule)
            progress_api.note(f"building {choice.name} and profiling it on this machine")
            model = build(choice.name, image=choice.image)
            sample = sample_input(choice.name, choice.batch, choice.image)
        else:
            progress_api.note(f"running {choice.file} to build the model")
            user = load_model_file(str(choice.file))
            model = user.model
            sample = user.sample(choice.shape, choice.default_shape)
            progress_api.note(f"capturing and profiling {type(model).__name__} on this machine")
        state = OPTIMIZER_STATES[optimizer] * sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )
        for p in model.parameters():  # train() keeps gradients (zero_grad(set_to_none=False)):
            if p.requires_grad and p.grad is None:  # plan for that loop from the first step
                p.grad = torch.zeros_like(p)
        if schedule is not None and choice.name is None:
            check_plan_for(schedule, as_stages(model, sample), sample, choice.label)
        net = Checkpointed(
            model,
            sample,
            memory_budget=memory,
            max_recompute=recompute,
            strategy=strategy,
            reserve_bytes=state,
            schedule=schedule,
        )
        with progress_api.task(f"training {choice.label}", total=steps) as step:
            result = train(
                net,
                sample,
                steps,
                optimizer=optimizer,
                lr=lr,
                seed=seed,
                on_step=lambda _done, loss: step(detail=f"loss {loss:.4f}"),
            )
    report: dict[str, Any] = {
        "model": choice.label,
        "batch": int(sample.shape[0]),
        "image": choice.image if choice.name is not None else None,
        "input_shape": list(sample.shape),
        "strategy": strategy,
        "stages": net.chain.length,
        "runs_as": net.runs_as,
        **asdict(result),
    }
    report["measured_over_predicted"] = result.measured_peak_bytes / result.predicted_peak_bytes
    return report


def machine_memory_bytes() -> int:
    """This machine's physical memory in bytes."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def _check_input_fits(choice: ModelChoice) -> None:
    """InvalidInput when the input batch alone (float32 images, int64 tokens) exceeds this
    machine's memory: it could never be allocated, so no training starts."""
    if choice.name is not None:
        tokens = MODELS[choice.name].input == "tokens"
        values = choice.batch * (choice.image if tokens else 3 * choice.image**2)
        needed = values * (8 if tokens else 4)
    elif choice.shape is not None:
        needed = math.prod(choice.shape) * 4
    else:
        return  # the factory's own example input, or one the factory sizes
    available = machine_memory_bytes()
    if needed > available:
        raise InvalidInput(
            f"the input alone ({input_words(choice.shape or choice.default_shape)}) needs "
            f"{format_bytes(needed)}, more than this machine's {format_bytes(available)} of "
            "memory; lower --batch or --image"
        )


def _check_on_meta(
    choice: ModelChoice, memory: int | None, optimizer: str, schedule: Schedule | None
) -> None:
    """A registered model's memory budget and given plan checked against its sizes, built on
    the meta device (in a moment, before it is built and profiled)."""
    from edgetrain.cli.plan import check_memory

    assert choice.name is not None
    with torch.device("meta"):
        sample = sample_input(choice.name, choice.batch, choice.image)
        model = build(choice.name, image=choice.image) if schedule is not None else None
    if memory is not None:
        check_memory(memory, choice.name, tuple(sample.shape), optimizer)
    if schedule is not None and model is not None:
        # a registered model uses every parameter: its stages hold them all
        check_plan_for(schedule, model, sample, choice.label)
