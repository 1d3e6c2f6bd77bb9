"""``insitu run``'s progress off a terminal: lines on stderr, nothing on stdout (which holds
the report and the JSON); "stopped" when the run is interrupted."""

from __future__ import annotations

import contextlib
import re

import pytest

from edgetrain import progress
from edgetrain.cli.insitu import _bars

PROGRESS = re.compile(r"^\d\d:\d\d:\d\d edgetrain: ")


@pytest.fixture
def every_step(monkeypatch):
    monkeypatch.setenv(progress.ENV, "log")
    monkeypatch.setattr(progress, "LOG_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(progress, "LOG_EVERY_SECONDS", 0.0)


def _run(bars, frames: int) -> None:
    f_task = bars.add_task("frames", total=10, info="")
    s_task = bars.add_task("training steps", total=None, info="waiting for capture")
    for k in range(1, frames + 1):
        bars.update(f_task, completed=k)
    bars.update(s_task, completed=3, total=6, info="loss 0.500")


def test_insitu_progress_goes_to_stderr_as_lines(capsys, every_step):
    with contextlib.ExitStack() as stack:
        _run(_bars(stack, as_json=False), 10)
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert any("frames: 10/10 (100%)" in line for line in lines), err
    assert any("training steps: 3/6 (50%), loss 0.500" in line for line in lines), err
    assert all(PROGRESS.match(line) for line in lines), err


def test_an_interrupted_insitu_run_says_stopped(capsys, every_step):
    with pytest.raises(KeyboardInterrupt), contextlib.ExitStack() as stack:
        _run(_bars(stack, as_json=False), 4)
        raise KeyboardInterrupt
    out, err = capsys.readouterr()
    assert out == "" and "frames: stopped at 4/10" in err and "done" not in err


def test_insitu_json_runs_show_no_progress(capsys, every_step):
    with contextlib.ExitStack() as stack:
        _run(_bars(stack, as_json=True), 10)
    assert capsys.readouterr() == ("", "")
