"""``benchmarks/zoo.py --quick`` runs from a clean checkout on one model and reports its row
(what it measures is a benchmark's business, not a test's: no timing is asserted here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "zoo.py"


@pytest.mark.slow
def test_quick_mode_reports_every_configuration_of_a_model():
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--models",
            "tv-resnet",
            "--rounds",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=280,
    )
    (row,) = json.loads(done.stdout)["rows"]
    assert row["model"] == "tv-resnet"
    assert row["construct_s"] > 0
    for key in ("mem/plain@1.15", "mem/plain@min", "ckpt mem/plain", "SAC mem/plain"):
        assert 0 < row[key] <= 1.0, key  # no configuration holds more than plain autograd
    assert row["pred/meas@min"] == pytest.approx(1.0, rel=0.05)
    assert row["overhead@min"] == pytest.approx(row["cpu/plain@min"] - row["rho_pred@min"])
