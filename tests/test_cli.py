"""The CLI: JSON shapes, tables, and one-line errors with exit status 2 for user mistakes."""

import json

import pytest
from click.testing import CliRunner

from edgetrain.cli.commands import COMMAND_MODULES  # noqa: F401  (registers the commands)
from edgetrain.cli.main import cli


def run(command: str, *extra: str):
    """Invoke ``edgetrain`` with the words of ``command`` and then ``extra`` arguments as given."""
    return CliRunner().invoke(cli, [*command.split(), *extra], catch_exceptions=False)


def test_memory_json_has_the_documented_shape():
    result = run("memory --models resnet18,resnet50 --batch 1,3,5 --image 224,500 --json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["unit"] == "MB"
    assert len(data["rows"]) == 12
    row = data["rows"][0]
    assert {"model", "batch", "image", "total_mb", "fits", "paper_mb"} <= row.keys()
    assert row["paper_mb"] == 230.05 and abs(row["error_percent"]) < 5
    big = next(
        r
        for r in data["rows"]
        if r["model"] == "resnet50" and r["batch"] == 5 and r["image"] == 500
    )
    assert big["fits"] is False  # above the 2 GB Waggle node, as the paper shades it


def test_memory_table_marks_cells_above_the_device():
    result = run("memory --models resnet18 --batch 1,30 --device-memory 1GB")
    assert result.exit_code == 0
    assert "resnet18" in result.output and "1825" in result.output


def test_memory_measure_prints_measured_beside_predicted():
    result = run("memory --models resnet18 --batch 1 --image 64 --measure --json")
    row = json.loads(result.output)["rows"][0]
    assert row["measured_mb"] == pytest.approx(row["autograd_total_mb"], rel=0.10)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["memory", "--models", "resnet19"], "unknown model"),
        (["memory", "--batch", "0"], "at least 1"),
        (["memory", "--batch", "x"], "whole number"),
        (["memory", "--image", "16"], "too small"),
        (["memory", "--device-memory", "2XB"], "cannot read size"),
        (["plan", "--memory", "1MB"], "does not hold the weights"),
        (
            ["plan", "--model", "resnet18", "--batch", "2", "--image", "64", "--memory", "145MB"],
            "smallest memory that works is",
        ),
        (["plan", "--recompute", "0.5"], "below 1"),
        (["plan", "--memory", "2GB", "--recompute", "2"], "not both"),
        (["revolve", "--steps", "0", "--slots", "3"], "at least 1"),
        (["train", "--model", "resnet18", "--steps", "0"], "at least 1"),
        (["train", "--model", "yolov2-16", "--image", "64"], "no classifier"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(args, message):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output


def test_plan_json_and_saved_plan_round_trip(tmp_path):
    path = tmp_path / "plan.json"
    result = run(
        "plan --model resnet18 --batch 2 --image 64 --recompute 1.5 --save", str(path), "--json"
    )
    data = json.loads(result.output)
    assert {"strategy", "peak_bytes", "recompute_factor", "stages"} <= data.keys()
    assert data["recompute_factor"] <= 1.5
    trained = run(
        "train --model resnet18 --batch 2 --image 64 --steps 2 --plan", str(path), "--json"
    )
    report = json.loads(trained.output)
    assert report["recompute_factor"] <= 1.5
    assert report["measured_over_predicted"] == pytest.approx(1.0, abs=0.02)


def test_train_refuses_a_corrupt_plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"format": "edgetrain-schedule", "version": 1, "ops": "Fa0", "sha256": "0"}')
    result = CliRunner().invoke(cli, ["train", "--plan", str(path), "--image", "64"])
    assert result.exit_code == 2
    assert "checksum" in result.output


def test_revolve_prints_pyrevolve_counts():
    data = json.loads(run("revolve --steps 100000 --slots 10 --json").output)
    assert data["forward_steps"] == data["optimal_forward_steps"] == 832040


def test_train_reports_measured_and_predicted_peak():
    result = run("train --model resnet18 --batch 2 --image 64 --steps 2 --memory 161MB --json")
    report = json.loads(result.output)
    assert report["predicted_peak_bytes"] <= 161e6
    assert report["measured_peak_bytes"] == pytest.approx(report["predicted_peak_bytes"], rel=0.02)
    assert report["plain_peak_bytes"] > report["predicted_peak_bytes"]


def test_the_demo_budget_is_feasible_and_below_plain_autograd():
    # scripts/run must work on its defaults: the demo trains ResNet-18, batch 16, 224x224.
    from edgetrain.cli.demo import demo
    from edgetrain.memory import fixed_training_bytes
    from edgetrain.planners.optimal import minimum_memory, store_all
    from edgetrain.profile import model_chain
    from edgetrain.schedule import simulate
    from edgetrain.units import parse_bytes

    defaults = {p.name: p.default for p in demo.params}
    chain = model_chain("resnet18", defaults["batch"], 224)
    fixed = fixed_training_bytes(chain, "momentum")
    budget = parse_bytes(defaults["memory"])
    plain = fixed + simulate(chain, store_all(chain)).peak_bytes
    assert fixed + minimum_memory(chain) < budget < plain
