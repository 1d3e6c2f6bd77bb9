"""``edgetrain plan``: a model's checkpointing plan for a memory budget or a recompute factor."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click
import torch

from edgetrain import progress
from edgetrain.cli.frontier import print_frontier, require_matplotlib
from edgetrain.cli.options import (
    RECOMPUTE,
    SIZE_HELP,
    ModelChoice,
    OutputFile,
    Size,
    choose_model,
    input_words,
    model_options,
)
from edgetrain.cli.output import console, emit_json, table
from edgetrain.core.accounting import OPTIMIZER_STATES, fixed_training_bytes, optimizer_state_bytes
from edgetrain.core.chain import Chain
from edgetrain.core.explain import PeakExplanation, explain_plan
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import simulate
from edgetrain.errors import InvalidInput
from edgetrain.frontend.profiling import NOMINAL_FLOPS, analytic_chain
from edgetrain.models import MODELS, build, model_chain
from edgetrain.models.factory import load_model_file
from edgetrain.planners import FRONTIER_STRATEGIES
from edgetrain.planners.optimal import store_all
from edgetrain.planners.search import plan_for_device
from edgetrain.runtime.checks import check_budget_holds_weights
from edgetrain.units import format_bytes, mib


@click.command(name="plan")
@model_options(default="resnet101", what="to plan for")
@click.option(
    "--strategy", type=click.Choice(FRONTIER_STRATEGIES), default="optimal", show_default=True
)
@click.option(
    "--memory",
    type=Size(),
    default=None,
    help=f"Device memory for training, e.g. 2GB or 1.5GiB ({SIZE_HELP}).",
)
@click.option(
    "--recompute",
    type=RECOMPUTE,
    default=None,
    help="Largest recompute factor (at least 1), e.g. 1.6.",
)
@click.option(
    "--optimizer",
    type=click.Choice(sorted(OPTIMIZER_STATES)),
    default="momentum",
    show_default=True,
    help="Optimizer whose state the memory must also hold.",
)
@click.option(
    "--save",
    "save_path",
    type=OutputFile(".json"),
    default=None,
    help="Write the plan to this .json file (its directory must exist).",
)
@click.option(
    "--explain",
    "explain",
    is_flag=True,
    help="Also show what is held at the predicted peak, by category and stage, and where.",
)
@click.option(
    "--frontier",
    "show_frontier",
    is_flag=True,
    help="Print the memory/time frontier (every Pareto plan, smallest budget to storing "
    "everything, the knee marked) instead of one plan.",
)
@click.option(
    "--out",
    type=OutputFile(".png", ".pdf", ".svg"),
    default=None,
    help="With --frontier: plot it to this image (needs the plot extra: matplotlib).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (sizes in bytes) instead.")
def plan_command(
    model_name: str | None,
    model_file: str | None,
    input_shape: tuple[int, ...] | None,
    batch: int,
    image: int,
    strategy: str,
    memory: int | None,
    recompute: float | None,
    optimizer: str,
    save_path: str | None,
    explain: bool,
    show_frontier: bool,
    out: str | None,
    as_json: bool,
) -> None:
    """Plan which activations to store and which to recompute.

    A registered model's chain comes from shapes alone (meta tensors); stage times are FLOP
    estimates, so the plan suits any device. A model with a forward() (the -module ResNets,
    mobilenetv2, unet, vit-tiny, tinylm, --model-file) is captured with torch.fx and cut into
    stages between its blocks and inside them; each stage is named for the first and last
    operation it runs, and "tensors" counts what crosses the cut after it (2 inside a residual
    block: the trunk and the skip). A --model-file model is built by running your factory and
    captured by running it once without grad. Without --memory or --recompute the plan stores
    everything. Sizes are printed in MiB/GiB (2^20/2^30 bytes).
    """
    if memory is not None and recompute is not None:
        raise InvalidInput("give --memory or --recompute, not both")
    if out is not None and not show_frontier:
        raise InvalidInput("--out plots the frontier; add --frontier")
    if show_frontier and (memory is not None or recompute is not None or save_path):
        raise InvalidInput("--frontier shows every budget; drop --memory, --recompute and --save")
    if out is not None:
        require_matplotlib("plan --out")
    choice = choose_model(model_name, model_file, input_shape, batch, image, default="resnet101")
    chain, shape = _chain(choice, memory, optimizer)
    fixed = fixed_training_bytes(chain, optimizer)
    if show_frontier:
        print_frontier(chain, strategy, fixed, shape, out, as_json)
        return
    budget = (
        "everything stored"
        if memory is None and recompute is None
        else (f"at most {format_bytes(memory)}" if memory is not None else f"rho <= {recompute}")
    )
    progress.note(f"planning {chain.length} stages ({strategy}, {budget})")
    schedule = plan_for_device(
        chain,
        strategy,
        device_bytes=memory,
        fixed_bytes=fixed,
        max_recompute=recompute,
        grads_exist=True,  # fixed holds the gradients kept from the last step
    )
    if save_path:
        try:
            schedule.save(save_path)
        except OSError as exc:
            raise InvalidInput(
                f"cannot write the plan to {save_path!r} ({exc.strerror}); pick another path"
            ) from exc
    report = describe(chain, schedule, fixed)
    report.update(
        model=chain.name,
        batch=shape[0],
        image=image if choice.name is not None else None,
        input_shape=list(shape),
        optimizer=optimizer,
    )
    explained = _explain(chain, schedule, optimizer) if explain else None
    if explained is not None:
        report["explain"] = explained.to_json()
    if as_json:
        emit_json(report)
        return
    _print_plan(report, chain.name, strategy, shape, fixed, save_path, explained)


def _print_plan(
    report: dict[str, Any],
    name: str,
    strategy: str,
    shape: tuple[int, ...],
    fixed: int,
    save_path: str | None,
    explained: PeakExplanation | None,
) -> None:
    """The plan's table of stages, its predicted peak and time, and what it holds at the peak."""
    several = any(s["tensors"] > 1 for s in report["stages"])
    console.print(
        table(
            f"{strategy} plan for {name}, {input_words(shape)}",
            [
                "stage",
                "output MiB",
                *(["tensors"] if several else []),
                "forwards",
                "first forward",
                "recomputed",
            ],
            [
                [
                    s["name"],
                    f"{mib(s['output_bytes']):.2f}",
                    *([s["tensors"]] if several else []),
                    s["forward_runs"],
                    s["first_forward"],
                    s["recomputations"],
                ]
                for s in report["stages"]
            ],
            caption="MiB = 2^20 bytes",
        )
    )
    console.print(
        f"predicted peak {format_bytes(report['peak_bytes'])} "
        f"(fixed {format_bytes(fixed)} + activations "
        f"{format_bytes(report['activation_peak_bytes'])}), "
        f"recompute factor {report['recompute_factor']:.3f}, "
        f"{report['predicted_seconds']:.3g} s per step at {NOMINAL_FLOPS / 1e9:g} GFLOP/s; "
        f"{report['summary']}" + (f"; saved to {save_path}" if save_path else "")
    )
    if explained is not None:
        console.print(str(explained), highlight=False, markup=False)


def _explain(chain: Chain, schedule: Schedule, optimizer: str) -> PeakExplanation:
    """What the plan holds at its predicted peak, in the loop ``describe`` counts (gradients
    kept from the last step: the fixed part holds them)."""
    fixed = {
        "weights": chain.weight_bytes,
        "gradients": chain.gradient_bytes,
        "optimizer state": optimizer_state_bytes(chain, optimizer),
        "buffers": chain.buffer_bytes,
        "input": chain.input_bytes,
    }
    plain = simulate(chain, store_all(chain), grads_exist=True).peak_bytes
    return explain_plan(chain, schedule, grads_exist=True, fixed=fixed, plain_peak_bytes=plain)


def _chain(
    choice: ModelChoice, memory: int | None = None, optimizer: str = "sgd"
) -> tuple[Chain, tuple[int, ...]]:
    """The analytic chain of the chosen model and the input shape it is for: a registered model
    on meta tensors, a user's built by their factory and captured on its input. A ``memory``
    below the weights, buffers, input and ``optimizer``'s state is refused before the chain is
    built (:func:`check_memory`)."""
    if choice.name is not None:
        shape = (
            (choice.batch, choice.image)
            if MODELS[choice.name].input == "tokens"
            else choice.default_shape
        )
        if memory is not None:
            check_memory(memory, choice.name, shape, optimizer)
        progress.note(f"building the chain of {choice.name} ({input_words(shape)})")
        return model_chain(choice.name, choice.batch, choice.image), shape
    progress.note(f"running {choice.file} to build the model")
    user = load_model_file(str(choice.file))
    sample = user.sample(choice.shape, choice.default_shape)
    if memory is not None:
        check_budget_holds_weights(memory, user.model, sample, _state_bytes(user.model, optimizer))
    progress.note(f"capturing {type(user.model).__name__} on an input {tuple(sample.shape)}")
    chain = analytic_chain(user.model, sample)
    named = replace(chain, name=choice.label)
    return named, tuple(sample.shape)


def check_memory(memory: int, name: str, shape: tuple[int, ...], optimizer: str) -> None:
    """InfeasibleBudget when ``memory`` cannot hold the registered model ``name``'s weights,
    buffers, an input of ``shape`` and ``optimizer``'s state, counted on the meta device (in a
    moment, before any chain is built)."""
    with torch.device("meta"):
        model = build(name, image=shape[-1])
    tokens = MODELS[name].input == "tokens"
    sample = torch.empty(shape, dtype=torch.long if tokens else torch.float32, device="meta")
    check_budget_holds_weights(memory, model, sample, _state_bytes(model, optimizer))


def _state_bytes(model: torch.nn.Module, optimizer: str) -> int:
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return OPTIMIZER_STATES[optimizer] * trained


_FIRST = {
    Op.FORWARD_ALL: "keep graph",
    Op.FORWARD_RELEASE: "keep graph, release input",
    Op.FORWARD_CHECKPOINT: "checkpoint",
    Op.FORWARD_NOSAVE: "drop",
}


def describe(chain: Chain, schedule: Schedule, fixed_total: int) -> dict[str, Any]:
    """The plan in numbers: peak (bytes), recompute factor, what it stores, and each stage's fate.

    ``graphs_kept`` counts stages whose first forward keeps its autograd graph (never recomputed),
    ``max_checkpoints`` the most stage inputs held as checkpoints at once, ``recomputed_stages``
    the stages run forward more than once; ``predicted_seconds`` is the plan's compute time from
    the chain's stage times (for a chain from shapes, FLOP counts at
    :data:`~edgetrain.frontend.profiling.NOMINAL_FLOPS`: relative, not this device's). Per stage,
    ``output_bytes`` adds up every tensor crossing the cut after it, ``tensors`` counts them.
    """
    # fixed_total holds the parameters' gradients from the last step, so the step adds to them
    cost = simulate(chain, schedule, grads_exist=True)
    runs = [0] * chain.length
    first: list[str] = [""] * chain.length
    for kind, k in schedule:
        if kind in _FIRST:
            if runs[k] == 0:
                first[k] = _FIRST[kind]
            runs[k] += 1
    stages = [
        {
            "name": stage.name,
            "output_bytes": stage.output_bytes,
            "forward_runs": runs[k],
            "first_forward": first[k],
            "recomputations": runs[k] - 1,
            "tensors": max(1, len(stage.leaf_bytes)),
        }
        for k, stage in enumerate(chain.stages)
    ]
    graphs = sum(1 for f in first if f in (_FIRST[Op.FORWARD_ALL], _FIRST[Op.FORWARD_RELEASE]))
    recomputed = sum(1 for r in runs if r > 1)
    return {
        "strategy": schedule.strategy,
        "peak_bytes": fixed_total + cost.peak_bytes,
        "activation_peak_bytes": cost.peak_bytes,
        "fixed_bytes": fixed_total,
        "recompute_factor": round(cost.recompute_factor, 6),
        "predicted_seconds": cost.seconds,
        "stages_total": chain.length,
        "graphs_kept": graphs,
        "max_checkpoints": cost.max_checkpoints,
        "recomputed_stages": recomputed,
        "summary": _summary(chain.length, graphs, cost.max_checkpoints, recomputed),
        "forward_steps": cost.forward_steps,
        "params": schedule.params,
        "stages": stages,
        "ops": schedule.text(),
    }


def _summary(stages: int, graphs: int, checkpoints: int, recomputed: int) -> str:
    """What the plan stores, in words that hold for store-all plans as for sparse ones."""
    if recomputed == 0:
        return f"keeps the graph of every stage ({stages}), recomputes nothing"
    return (
        f"keeps the graphs of {graphs} of {stages} stages, holds at most {checkpoints} "
        f"checkpoint{'s' if checkpoints != 1 else ''} at once, recomputes {recomputed} "
        f"stage{'s' if recomputed != 1 else ''}"
    )
