"""``edgetrain plan``: a model's checkpointing plan for a memory budget or a recompute factor."""

from __future__ import annotations

from typing import Any

import click

from edgetrain.chain import Chain
from edgetrain.cli.main import register
from edgetrain.cli.options import size
from edgetrain.cli.output import console, emit_json, table
from edgetrain.memory import OPTIMIZER_STATES, fixed_training_bytes
from edgetrain.planners import STRATEGIES
from edgetrain.planners.search import plan_for_device
from edgetrain.profile import model_chain
from edgetrain.schedule import Op, Schedule, simulate
from edgetrain.units import format_bytes, mib


@click.command(name="plan")
@click.option("--model", "model_name", default="resnet101", show_default=True)
@click.option("--batch", default=8, show_default=True, type=int)
@click.option("--image", default=224, show_default=True, type=int)
@click.option("--strategy", type=click.Choice(STRATEGIES), default="optimal", show_default=True)
@click.option("--memory", default=None, help="Device memory for training, e.g. 2GB.")
@click.option("--recompute", type=float, default=None, help="Largest recompute factor, e.g. 1.6.")
@click.option(
    "--optimizer",
    type=click.Choice(sorted(OPTIMIZER_STATES)),
    default="momentum",
    show_default=True,
    help="Optimizer whose state the memory must also hold.",
)
@click.option("--save", "save_path", default=None, help="Write the plan to this JSON file.")
@click.option("--json", "as_json", is_flag=True)
def plan_command(
    model_name: str,
    batch: int,
    image: int,
    strategy: str,
    memory: str | None,
    recompute: float | None,
    optimizer: str,
    save_path: str | None,
    as_json: bool,
) -> None:
    """Plan which activations to store and which to recompute.

    The chain comes from shapes alone (meta tensors); stage times are FLOP estimates, so the
    plan suits any device. Without --memory or --recompute the plan stores everything.
    """
    chain = model_chain(model_name, batch, image)
    fixed = fixed_training_bytes(chain, optimizer)
    schedule = plan_for_device(
        chain, strategy, device_bytes=size(memory), fixed_bytes=fixed, recompute=recompute
    )
    if save_path:
        schedule.save(save_path)
    report = describe(chain, schedule, fixed)
    report.update(model=chain.name, batch=batch, image=image, optimizer=optimizer)
    if as_json:
        emit_json(report)
        return
    console.print(
        table(
            f"{strategy} plan for {chain.name}, batch {batch}, {image}x{image}",
            ["stage", "output MB", "forwards", "first forward", "recomputed"],
            [
                [
                    s["name"],
                    f"{s['output_mb']:.2f}",
                    s["forward_runs"],
                    s["first_forward"],
                    s["recomputations"],
                ]
                for s in report["stages"]
            ],
        )
    )
    console.print(
        f"predicted peak {format_bytes(report['peak_bytes'])} "
        f"(fixed {format_bytes(fixed)} + activations "
        f"{format_bytes(report['activation_peak_bytes'])}), "
        f"recompute factor {report['recompute_factor']:.3f}, "
        f"at most {report['stored_activations']} activations stored"
        + (f"; saved to {save_path}" if save_path else "")
    )


_FIRST = {
    Op.FORWARD_ALL: "keep graph",
    Op.FORWARD_CHECKPOINT: "checkpoint",
    Op.FORWARD_NOSAVE: "drop",
}


def describe(chain: Chain, schedule: Schedule, fixed_total: int) -> dict[str, Any]:
    """The plan in numbers: peak, recompute factor, and what happens to each stage."""
    cost = simulate(chain, schedule)
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
            "output_mb": round(mib(stage.output_bytes), 3),
            "forward_runs": runs[k],
            "first_forward": first[k],
            "recomputations": runs[k] - 1,
        }
        for k, stage in enumerate(chain.stages)
    ]
    return {
        "strategy": schedule.strategy,
        "peak_bytes": fixed_total + cost.peak_bytes,
        "activation_peak_bytes": cost.peak_bytes,
        "fixed_bytes": fixed_total,
        "recompute_factor": round(cost.recompute_factor, 6),
        "stored_activations": cost.max_checkpoints,
        "forward_steps": cost.forward_steps,
        "params": schedule.params,
        "stages": stages,
        "ops": schedule.text(),
    }


register(plan_command)
