"""``benchmarks/executor_overhead.py --per-stage`` runs from a clean checkout and reports its rows
(what it measures is a benchmark's business, not a test's: no timing is asserted here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "executor_overhead.py"


def test_per_stage_mode_reports_both_steps_for_each_traffic_setting():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--per-stage", "--traffic", "0,1", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rows = json.loads(done.stdout)["rows"]
    assert [row["traffic_MiB"] for row in rows] == [0, 1]
    for row in rows:
        for key in ("plain_fwd_us", "executor_fwd_us", "plain_bwd_us", "executor_bwd_us"):
            assert row[key] > 0, key
        assert row["excess_us"] == pytest.approx(
            row["executor_fwd_us"]
            + row["executor_bwd_us"]
            - row["plain_fwd_us"]
            - row["plain_bwd_us"]
        )
