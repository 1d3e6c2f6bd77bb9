"""A task ended by an interrupt or an error says "stopped" and how far it came, never "done"."""

import io

import pytest

from edgetrain import progress
from tests.test_progress import Terminal


def test_an_interrupted_task_logs_stopped_not_done(monkeypatch):
    monkeypatch.setenv(progress.ENV, "log")
    stream = io.StringIO()
    monkeypatch.setattr(progress, "LOG_AFTER_SECONDS", 0.0)  # log from the first step on
    monkeypatch.setattr(progress, "LOG_EVERY_SECONDS", 0.0)
    with pytest.raises(KeyboardInterrupt), progress.task("training m", 10, stream=stream) as step:
        for _ in range(4):
            step()
        raise KeyboardInterrupt
    lines = stream.getvalue().splitlines()
    assert lines, "the task logged nothing"
    assert "training m: stopped at 4/10 after" in lines[-1]
    assert not any("done" in line for line in lines)


def test_an_interrupted_bar_leaves_a_stopped_line_on_the_terminal(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    stream = Terminal()
    with pytest.raises(KeyboardInterrupt), progress.task("training m", 10, stream=stream) as step:
        step(2)
        raise KeyboardInterrupt
    assert progress._bars.progress is None
    assert "training m: stopped at 2/10" in stream.getvalue()


def test_a_task_that_ends_normally_still_says_done(monkeypatch):
    monkeypatch.setenv(progress.ENV, "log")
    stream = io.StringIO()
    monkeypatch.setattr(progress, "LOG_AFTER_SECONDS", 0.0)  # log from the first step on
    monkeypatch.setattr(progress, "LOG_EVERY_SECONDS", 0.0)
    with progress.task("training m", total=2, stream=stream) as step:
        step(2)
    assert "training m: done in" in stream.getvalue().splitlines()[-1]
