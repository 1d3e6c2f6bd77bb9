"""``edgetrain plan``: a model's checkpointing plan for a memory budget or a recompute factor."""

from __future__ import annotations

from typing import Any

import click

from edgetrain import progress
from edgetrain.chain import Chain
from edgetrain.cli.main import register
from edgetrain.cli.options import POSITIVE, RECOMPUTE, SIZE_HELP, ModelName, OutputFile, Size
from edgetrain.cli.output import console, emit_json, table
from edgetrain.errors import InvalidInput
from edgetrain.memory import OPTIMIZER_STATES, fixed_training_bytes
from edgetrain.planners import STRATEGIES
from edgetrain.planners.search import plan_for_device
from edgetrain.profile import model_chain
from edgetrain.schedule import Op, Schedule, simulate
from edgetrain.units import format_bytes, mib


@click.command(name="plan")
@click.option(
    "--model",
    "model_name",
    type=ModelName(),
    default="resnet101",
    show_default=True,
    help="Model to plan for (the registry's nn.Sequential models; `edgetrain models` lists all).",
)
@click.option("--batch", type=POSITIVE, default=8, show_default=True, help="Images per step.")
@click.option("--image", type=POSITIVE, default=224, show_default=True, help="Image side (px).")
@click.option("--strategy", type=click.Choice(STRATEGIES), default="optimal", show_default=True)
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
@click.option("--json", "as_json", is_flag=True, help="Print JSON (sizes in bytes) instead.")
def plan_command(
    model_name: str,
    batch: int,
    image: int,
    strategy: str,
    memory: int | None,
    recompute: float | None,
    optimizer: str,
    save_path: str | None,
    as_json: bool,
) -> None:
    """Plan which activations to store and which to recompute.

    The chain comes from shapes alone (meta tensors); stage times are FLOP estimates, so the
    plan suits any device. Without --memory or --recompute the plan stores everything.
    Sizes are printed in MiB/GiB (2^20/2^30 bytes).
    """
    from edgetrain.models import check_image

    check_image(model_name, image, batch)
    progress.note(f"building the chain of {model_name} (batch {batch}, {image}x{image})")
    chain = model_chain(model_name, batch, image)
    fixed = fixed_training_bytes(chain, optimizer)
    budget = (
        "everything stored"
        if memory is None and recompute is None
        else (f"at most {format_bytes(memory)}" if memory is not None else f"rho <= {recompute}")
    )
    progress.note(f"planning {chain.length} stages ({strategy}, {budget})")
    schedule = plan_for_device(
        chain, strategy, device_bytes=memory, fixed_bytes=fixed, recompute=recompute
    )
    if save_path:
        try:
            schedule.save(save_path)
        except OSError as exc:
            raise InvalidInput(
                f"cannot write the plan to {save_path!r} ({exc.strerror}); pick another path"
            ) from exc
    report = describe(chain, schedule, fixed)
    report.update(model=chain.name, batch=batch, image=image, optimizer=optimizer)
    if as_json:
        emit_json(report)
        return
    console.print(
        table(
            f"{strategy} plan for {chain.name}, batch {batch}, {image}x{image}",
            ["stage", "output MiB", "forwards", "first forward", "recomputed"],
            [
                [
                    s["name"],
                    f"{mib(s['output_bytes']):.2f}",
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
        f"recompute factor {report['recompute_factor']:.3f}; {report['summary']}"
        + (f"; saved to {save_path}" if save_path else "")
    )


_FIRST = {
    Op.FORWARD_ALL: "keep graph",
    Op.FORWARD_CHECKPOINT: "checkpoint",
    Op.FORWARD_NOSAVE: "drop",
}


def describe(chain: Chain, schedule: Schedule, fixed_total: int) -> dict[str, Any]:
    """The plan in numbers: peak (bytes), recompute factor, what it stores, and each stage's fate.

    ``graphs_kept`` counts stages whose first forward keeps its autograd graph (never recomputed),
    ``max_checkpoints`` the most stage inputs held as checkpoints at once, ``recomputed_stages``
    the stages run forward more than once.
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
        }
        for k, stage in enumerate(chain.stages)
    ]
    graphs = sum(1 for f in first if f == _FIRST[Op.FORWARD_ALL])
    recomputed = sum(1 for r in runs if r > 1)
    return {
        "strategy": schedule.strategy,
        "peak_bytes": fixed_total + cost.peak_bytes,
        "activation_peak_bytes": cost.peak_bytes,
        "fixed_bytes": fixed_total,
        "recompute_factor": round(cost.recompute_factor, 6),
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


register(plan_command)
