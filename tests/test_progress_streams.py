"""Progress goes to stderr only, as separate lines when stderr is not a terminal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgetrain import progress
from edgetrain.cli.main import cli

DATA = Path(__file__).parent / "data" / "poet_linear_m0.json"
LINE = re.compile(r"^\d\d:\d\d:\d\d edgetrain: ")


def test_poet_figure_reports_each_solve_on_its_own_stderr_line(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv(progress.ENV, "log")
    monkeypatch.setattr(progress, "LOG_AFTER_SECONDS", 0.0)  # every solve, however quick
    monkeypatch.setattr(progress, "LOG_EVERY_SECONDS", 0.0)
    result = CliRunner().invoke(
        cli,
        ["poet-figure", "--graph", str(DATA), "--runtime", "2", "--accounting", "poet",
         "--points", "2", "--smallest", "0.5", "--out", str(tmp_path / "p.png")],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "\r" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) >= 6, result.stderr  # 3 modes x 2 budgets, then the closing line
    assert all(LINE.match(line) for line in lines), result.stderr
    assert "solving" not in result.stdout
