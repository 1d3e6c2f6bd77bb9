"""A --model-file whose import or factory never returns is stopped by a time limit: one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.models.factory import load_model_file

ROOT = Path(__file__).resolve().parents[2]

LOOPS = "def build():\n    while True:\n        pass\n"
SWALLOWS = (
    "import time\n"
    "def build():\n"
    "    while True:\n"
    "        try:\n"
    "            time.sleep(0.05)\n"
    "        except Exception:\n"
    "            pass\n"
)
IMPORT_LOOPS = "while True:\n    pass\ndef build():\n    return None\n"
QUICK = "from torch import nn\ndef build():\n    return nn.Linear(2, 2)\n"


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "my_model.py"
    path.write_text(text)
    return f"{path}:build"


@pytest.mark.parametrize("text", [LOOPS, SWALLOWS], ids=["loop", "swallows-exceptions"])
def test_a_factory_that_never_returns_is_stopped(tmp_path, text):
    spec = _file(tmp_path, text)
    with pytest.raises(InvalidInput) as caught:
        load_model_file(spec, seconds=0.5)
    assert str(caught.value) == (
        f"{spec} did not return within 0.5 s (an endless loop?); make it return the model"
    )


def test_a_file_whose_import_never_ends_is_stopped(tmp_path):
    spec = _file(tmp_path, IMPORT_LOOPS)
    with pytest.raises(InvalidInput, match=r"did not finish within 0\.5 s"):
        load_model_file(spec, seconds=0.5)


def test_a_quick_factory_loads_and_leaves_no_timer_behind(tmp_path):
    before = signal.getsignal(signal.SIGALRM)
    user = load_model_file(_file(tmp_path, QUICK), seconds=5)
    assert isinstance(user.model, nn.Linear)
    assert signal.getsignal(signal.SIGALRM) is before
    deadline = time.monotonic() + 5
    while any(isinstance(t, threading.Timer) for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the factory's timer thread is still running"
        time.sleep(0.01)


@pytest.mark.parametrize("command", ["plan", "train"])
def test_the_cli_ends_an_endless_factory_in_one_line_exit_2(tmp_path, command):
    spec = _file(tmp_path, LOOPS)
    code = (
        "import edgetrain.models.factory as factory\n"
        "factory.FACTORY_SECONDS = 1.0\n"
        "from edgetrain.cli.main import main\n"
        "main()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, command, "--model-file", spec, "--input-shape", "1,2"],
        cwd=ROOT,
        env={**os.environ, "EDGETRAIN_PROGRESS": "0", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"edgetrain: error: {spec} did not return within 1 s (an endless loop?); make it "
        "return the model"
    ]
