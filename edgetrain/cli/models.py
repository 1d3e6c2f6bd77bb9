"""``edgetrain models``: the models built from code, what each is and what input it takes."""

from __future__ import annotations

import click

from edgetrain.cli.output import console, emit_json, table


@click.command(name="models")
@click.option("--json", "as_json", is_flag=True)
def models_command(as_json: bool) -> None:
    """List the models edgetrain builds from code (nothing is downloaded)."""
    from edgetrain.models import model_table

    rows = model_table()
    if as_json:
        emit_json(rows)
        return
    console.print(
        table(
            "Models built from code",
            ["name", "description", "input", "nn.Sequential"],
            [
                [r["name"], r["description"], r["input"], "yes" if r["sequential"] else "no"]
                for r in rows
            ],
            caption="nn.Sequential models are chains of stages; the others have a forward() "
            "and are captured with torch.fx. plan and train take them all, "
            "and your own with --model-file my_model.py:build "
            '(edgetrain.models.load_factory("my_model.py:build") in Python).',
        )
    )
