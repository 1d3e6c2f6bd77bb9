"""The CLI: JSON shapes, tables, and one-line errors with exit status 2 for user mistakes."""

import json
import re

import pytest
from click.testing import CliRunner

from edgetrain.cli.main import cli

PROGRESS_LINE = re.compile(r"^\d\d:\d\d:\d\d edgetrain: ")
"""A progress line on stderr (edgetrain.progress off a terminal): not part of the error."""


def run(command: str, *extra: str):
    """Invoke ``edgetrain`` with the words of ``command`` and then ``extra`` arguments as given."""
    return CliRunner().invoke(cli, [*command.split(), *extra], catch_exceptions=False)


def test_memory_json_has_the_documented_shape():
    result = run("memory --models resnet18,resnet50 --batch 1,3,5 --image 224,500 --json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["device_memory_bytes"] == 2 * 2**30
    assert len(data["rows"]) == 12
    row = data["rows"][0]
    assert {"model", "batch", "image", "total_bytes", "fits", "paper_mib"} <= row.keys()
    assert row["paper_mib"] == 230.05 and abs(row["error_percent"]) < 5
    assert row["error_percent"] == pytest.approx(
        100 * (row["total_bytes"] / 2**20 / row["paper_mib"] - 1), abs=0.01
    )
    big = next(
        r
        for r in data["rows"]
        if r["model"] == "resnet50" and r["batch"] == 5 and r["image"] == 500
    )
    assert big["fits"] is False  # above the 2 GB Waggle node, as the paper shades it


def test_memory_table_marks_cells_above_the_device():
    result = run("memory --models resnet18 --batch 1,30 --memory 1GB")
    assert result.exit_code == 0
    assert "resnet18" in result.output and "1825" in result.output


def test_memory_measure_prints_measured_beside_predicted():
    result = run("memory --models resnet18 --batch 1 --image 64 --measure --json")
    row = json.loads(result.stdout)["rows"][0]
    assert row["measured_bytes"] == pytest.approx(row["autograd_total_bytes"], rel=0.10)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["memory", "--models", "resnet19"], "unknown model"),
        (["memory", "--batch", "0"], "at least 1"),
        (["memory", "--batch", "x"], "whole number"),
        (["memory", "--image", "16"], "too small"),
        (["memory", "--memory", "2XB"], "cannot read size"),
        (["plan", "--memory", "1MB"], "the step starts with"),
        (
            ["plan", "--model", "resnet18", "--batch", "2", "--image", "64", "--memory", "145MB"],
            "smallest memory that works is",
        ),
        (["plan", "--recompute", "0.5"], "0.5 is not in the range x>=1"),
        (["plan", "--memory", "2GB", "--recompute", "2"], "not both"),
        (["revolve", "--steps", "0", "--slots", "3"], "0 is not in the range x>=1"),
        (["train", "--model", "resnet18", "--steps", "0"], "0 is not in the range x>=1"),
        (["train", "--model", "yolov3", "--image", "64"], "unknown model 'yolov3'"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(args, message):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    lines = [line for line in lines if not PROGRESS_LINE.match(line)]
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output


def test_plan_json_and_saved_plan_round_trip(tmp_path):
    path = tmp_path / "plan.json"
    result = run(
        "plan --model resnet18 --batch 2 --image 64 --recompute 1.5 --save", str(path), "--json"
    )
    data = json.loads(result.stdout)
    assert {"strategy", "peak_bytes", "recompute_factor", "stages"} <= data.keys()
    assert data["recompute_factor"] <= 1.5
    trained = run(
        "train --model resnet18 --batch 2 --image 64 --steps 2 --plan", str(path), "--json"
    )
    report = json.loads(trained.stdout)
    assert report["recompute_factor"] <= 1.5
    assert report["measured_over_predicted"] == pytest.approx(1.0, abs=0.02)


def test_train_refuses_a_corrupt_plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"format": "edgetrain-schedule", "version": 1, "ops": "Fa0", "sha256": "0"}')
    result = CliRunner().invoke(cli, ["train", "--plan", str(path), "--image", "64"])
    assert result.exit_code == 2
    assert "checksum" in result.output


def test_revolve_prints_pyrevolve_counts():
    data = json.loads(run("revolve --steps 100000 --slots 10 --json").stdout)
    assert data["forward_steps"] == data["optimal_forward_steps"] == 832040


def _smallest_and_plain(setting: str) -> tuple[int, int]:
    """The least device memory any plan needs (quoted by the budget error) and plain autograd's."""
    plain = json.loads(run(f"plan {setting} --json").stdout)
    refused = CliRunner().invoke(cli, [*f"plan {setting}".split(), "--memory", "141MB"])
    assert refused.exit_code == 2, refused.output
    smallest = int(re.search(r"\((\d+) bytes\)", refused.output).group(1))
    return smallest, plain["peak_bytes"]


def test_train_reports_measured_and_predicted_peak():
    # Just above the least the profiled model needs (its kernels' scratch included, which the
    # shape-based plan command does not see): the plan must recompute.
    setting = "--model resnet18 --batch 2 --image 64 --steps 2"
    refused = CliRunner().invoke(cli, [*f"train {setting}".split(), "--memory", "141MB"])
    assert refused.exit_code == 2, refused.output
    smallest = int(re.search(r"\((\d+) bytes\)", refused.output).group(1))
    budget = int(smallest * 1.01)
    result = run(f"train {setting} --memory {budget} --json")
    report = json.loads(result.stdout)
    assert report["predicted_peak_bytes"] <= budget
    assert report["measured_peak_bytes"] == pytest.approx(report["predicted_peak_bytes"], rel=0.02)
    assert report["plain_peak_bytes"] > report["predicted_peak_bytes"]


def test_the_demo_budget_is_feasible_and_below_plain_autograd():
    # scripts/run must work on its defaults: the demo trains ResNet-18, batch 16, 224x224.
    from edgetrain.cli.demo import demo
    from edgetrain.core.accounting import fixed_training_bytes
    from edgetrain.core.simulator import simulate
    from edgetrain.models import model_chain
    from edgetrain.planners.optimal import minimum_memory, store_all
    from edgetrain.units import parse_bytes

    defaults = {p.name: p.default for p in demo.params}
    chain = model_chain("resnet18", defaults["batch"], 224)
    fixed = fixed_training_bytes(chain, "momentum")
    budget = parse_bytes(defaults["memory"])
    plain = fixed + simulate(chain, store_all(chain)).peak_bytes
    assert fixed + minimum_memory(chain) < budget < plain


def _keys(data):
    """Every key of a JSON document, at any depth."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield key
            yield from _keys(value)
    elif isinstance(data, list):
        for value in data:
            yield from _keys(value)


@pytest.mark.parametrize(
    "command",
    [
        "memory --models resnet18 --batch 1 --image 64 --json",
        "plan --model resnet18 --batch 2 --image 64 --recompute 1.3 --json",
    ],
)
def test_json_sizes_name_their_unit(command):
    data = json.loads(run(command).stdout)
    keys = set(_keys(data))
    assert not {k for k in keys if k.endswith("_mb") or k == "unit"}, keys
    sizes = {k for k in keys if k.endswith("_bytes")}
    assert sizes
    rows = data.get("rows", [data])
    for row in rows:
        for key in sizes & row.keys():
            assert row[key] is None or isinstance(row[key], int), (key, row[key])


def test_plan_summary_says_what_a_store_all_plan_keeps():
    # a plan that keeps every graph says so, not "at most 0 activations stored"
    table_text = run("plan --model resnet18 --batch 2 --image 64 --memory 2GB").stdout
    assert "0 activations" not in table_text
    assert "keeps the graph of every stage (10), recomputes nothing" in " ".join(table_text.split())
    data = json.loads(run("plan --model resnet18 --batch 2 --image 64 --memory 2GB --json").stdout)
    assert data["graphs_kept"] == data["stages_total"] == len(data["stages"])
    assert data["recomputed_stages"] == 0


def test_plan_summary_counts_what_a_sparse_plan_keeps_and_recomputes():
    setting = "--model resnet18 --batch 2 --image 64"
    smallest, _ = _smallest_and_plain(setting)
    data = json.loads(run(f"plan {setting} --json --memory {smallest}").stdout)
    stages = data["stages"]
    assert data["graphs_kept"] == sum(s["first_forward"] == "keep graph" for s in stages)
    assert data["recomputed_stages"] == sum(s["recomputations"] > 0 for s in stages) > 0
    assert data["max_checkpoints"] >= 1
    assert f"recomputes {data['recomputed_stages']} stage" in data["summary"]


def test_a_budget_error_quotes_a_total_the_plan_then_meets():
    # the smallest memory an error quotes is a device total, as the table's predicted peak is
    words = "plan --model resnet18 --batch 2 --image 64 --memory 145MB --json"
    result = CliRunner().invoke(cli, words.split())
    assert result.exit_code == 2
    smallest = int(re.search(r"\((\d+) bytes\)", result.output).group(1))
    data = json.loads(
        run("plan --model resnet18 --batch 2 --image 64 --json --memory", str(smallest)).stdout
    )
    assert data["peak_bytes"] <= smallest
    assert data["peak_bytes"] == data["fixed_bytes"] + data["activation_peak_bytes"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("memory --models resnet18 --batch 1 --device-memory 1GB", "--memory"),
        ("tiles --grid 0x1 --profile pi3-wifi", "--device"),
    ],
)
def test_renamed_flags_still_work_for_one_release_and_say_the_new_name(old, new):
    result = CliRunner().invoke(cli, old.split())
    assert f"is now {new}" in result.stderr
    assert "no such option" not in result.stderr
