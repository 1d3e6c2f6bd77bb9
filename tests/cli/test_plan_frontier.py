"""``edgetrain plan --frontier``: every Pareto plan, the smallest budget and the knee; each
budget it prints plans with ``--memory``, one byte less than the smallest does not."""

from __future__ import annotations

import json

from click.testing import CliRunner

from edgetrain.cli.main import cli

QUICK = ["--model", "resnet18", "--batch", "1", "--image", "64"]


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_the_frontier_table_runs_from_the_smallest_budget_to_storing_everything():
    result = run("plan", *QUICK, "--frontier", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    points = report["points"]
    assert len(points) > 2
    budgets = [p["budget_bytes"] for p in points]
    assert budgets == sorted(set(budgets))
    assert points[-1]["recompute_factor"] == 1.0
    assert sum(p["knee"] for p in points) == 1
    smallest = budgets[0]
    planned = run("plan", *QUICK, "--memory", str(smallest), "--json")
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.stdout)["peak_bytes"] <= smallest
    refused = run("plan", *QUICK, "--memory", str(smallest - 1))
    assert refused.exit_code == 2
    assert f"({smallest} bytes)" in refused.output
    table = run("plan", *QUICK, "--frontier")
    assert table.exit_code == 0 and "knee" in table.stdout and "smallest" in table.stdout


def test_out_needs_the_frontier():
    result = run("plan", *QUICK, "--out", "frontier.png")
    assert result.exit_code == 2
    assert "--frontier" in result.output
