"""``edgetrain revolve``: counts of the binomial checkpointing schedule, like pyrevolve's."""

from __future__ import annotations

import time

import click

from edgetrain.cli.options import POSITIVE
from edgetrain.cli.output import console, emit_json, table
from edgetrain.core.schedule import Op
from edgetrain.errors import InvalidInput
from edgetrain.planners.revolve import optimal_forward_steps, repetitions, revolve_steps


@click.command(name="revolve")
@click.option("--steps", type=POSITIVE, required=True, help="Chain length l (at least 1).")
@click.option(
    "--slots", type=POSITIVE, required=True, help="Checkpoint slots s (the input takes one)."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def revolve_command(steps: int, slots: int, as_json: bool) -> None:
    """Plan Revolve for a homogeneous chain of STEPS stages with SLOTS slots and count it.

    No model: the paper's homogeneous chain (every stage costs 1).
    """
    if steps < 1 or slots < 1:
        raise InvalidInput("--steps and --slots must be at least 1")
    start = time.perf_counter()
    schedule = revolve_steps(steps, slots)
    seconds = time.perf_counter() - start
    data = {
        "steps": steps,
        "slots": slots,
        "forward_steps": schedule.forward_steps,
        "optimal_forward_steps": optimal_forward_steps(steps, slots),
        "backward_steps": schedule.count(Op.BACKWARD),
        "taped_forward_steps": schedule.count(Op.FORWARD_ALL),
        "snapshots": schedule.params["snapshots"],
        "repetitions": repetitions(steps, min(slots, steps)),
        "recompute_factor": (schedule.forward_steps + 2 * steps) / (2 * steps),
        "operations": len(schedule),
        "plan_seconds": round(seconds, 4),
    }
    if as_json:
        emit_json(data)
        return
    console.print(
        table(
            f"Revolve, {steps} steps, {slots} slots",
            ["count", "value"],
            [[k, v] for k, v in data.items()],
            caption="forward_steps counts advances (pyrevolve's numforw); the forward "
            "before each backward is fused with it",
        )
    )
