"""``edgetrain poet`` / ``poet-figure``: the documented JSON, POET's matrices, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgetrain.cli.main import cli
from edgetrain.planners.poet import check as poet_check
from edgetrain.planners.poet import graph as G

DATA = Path(__file__).parents[1] / "data" / "poet_linear_m0.json"


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _matrices(listed: dict, size: int) -> dict:  # type: ignore[type-arg]
    out = {}
    for key, rows in listed.items():
        matrix = np.zeros((size, size), dtype=np.int64)
        for t, ids in enumerate(rows):
            matrix[t, ids] = 1
        out[key] = matrix
    return out


def test_poet_instance_json_has_the_documented_fields_and_checkable_matrices() -> None:
    result = run(
        "poet", "--graph", str(DATA), "--memory", "3500", "--runtime", "2",
        "--accounting", "poet", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("status", "energy_J", "lower_bound_J", "gap", "solve_seconds", "peak_ram_bytes",
                "runtime_s", "matrices"):  # fmt: skip
        assert key in data
    assert data["status"] == "optimal"
    assert data["energy_J"] == pytest.approx(0.1048577428, rel=1e-9)
    graph = G.load(DATA)
    plan = _matrices(data["matrices"], len(graph))
    assert set(plan) == {"R", "S_ram", "S_flash", "page_in", "page_out"}
    assert poet_check.violations(graph, plan) == []
    cost = poet_check.evaluate(graph, plan, "poet")
    assert cost.peak_ram_bytes == data["peak_ram_bytes"] <= 3500
    assert cost.energy_joules == pytest.approx(data["energy_J"])
    assert "solving:" in result.stderr  # the progress line


def test_infeasible_budget_prints_the_result_then_one_line_and_exit_2() -> None:
    result = run(
        "poet", "--graph", str(DATA), "--memory", "3000", "--runtime", "2",
        "--accounting", "poet", "--json",
    )  # fmt: skip
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["status"] == "infeasible" and data["matrices"] is None
    assert 3000 < data["smallest_ram_bytes"] <= 3500
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("edgetrain: error: no plan fits") and "smallest RAM" in last


def test_model_on_a_device_profile_with_a_percentage_budget() -> None:
    result = run("poet", "--model", "resnet18", "--device", "m4f", "--memory", "100%", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["status"] == "optimal" and data["gap"] == 0
    assert data["device"] == "m4f" and data["recomputed"] == 0
    assert data["peak_ram_bytes"] <= data["ram_budget_bytes"]


def test_table_output_names_the_energy_split() -> None:
    result = run("poet", "--graph", str(DATA), "--memory", "4000", "--runtime", "2")
    assert result.exit_code == 0
    for word in ("compute", "page-in", "page-out", "lower bound", "gap", "peak RAM"):
        assert word in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "pdp11"], "unknown device"),
        (["--graph", "missing.json"], "cannot read graph"),
        (["--memory", "lots"], "cannot read size"),
        (["--memory", "-5%"], "positive"),
        (["--runtime", "0"], "positive factor"),
        (["--time-limit", "0"], "positive seconds"),
        (["--time-limit", "inf"], "positive seconds"),
        (["--runtime", "nan"], "positive factor"),
        (["--device", "this", "--page-dir", ".", "--watts", "nan"], "watts"),
        (["--graph", str(DATA), "--device", "m0"], "drop --device"),
        (["--device", "this"], "--page-dir"),
        (["--device", "this", "--page-dir", "/nonexistent/dir", "--watts", "5"], "writable"),
        (["--batch", "1", "--image", "32"], "too small"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = run("poet", *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_malformed_graph_file_is_one_line(tmp_path: Path) -> None:
    raw = json.loads(DATA.read_text())
    raw["edges"].append([26, 0])
    path = tmp_path / "cycle.json"
    path.write_text(json.dumps(raw))
    result = run("poet", "--graph", str(path))
    assert result.exit_code == 2 and "cycle" in result.stderr
    path.write_text(json.dumps({**raw, "format": "poet-instance-v0"}))
    result = run("poet", "--graph", str(path))
    assert result.exit_code == 2 and "format tag" in result.stderr


def test_export_graph_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    result = run("poet", "--device", "m0", "--export-graph", str(out), "--json")
    assert result.exit_code == 0
    graph = G.load(out)
    assert graph.device == "m0" and graph.name == "resnet18"
    again = run("poet", "--graph", str(out), "--json")
    assert json.loads(again.stdout)["energy_J"] == json.loads(result.stdout)["energy_J"]


def test_poet_figure_draws_three_modes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "poet.png"
    result = run(
        "poet-figure", "--graph", str(DATA), "--runtime", "2", "--accounting", "poet",
        "--points", "3", "--smallest", "0.5", "--out", str(out), "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["curves"]) == {"hybrid", "remat", "paging"}
    assert out.stat().st_size > 0
    hybrid = [p["energy_J"] for p in data["curves"]["hybrid"]]
    assert hybrid[-1] == pytest.approx(G.load(DATA).compute_joules)
