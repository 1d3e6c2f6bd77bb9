"""Progress: plain log lines off a terminal, throttled; silent when asked; a bar on a terminal."""

import io

import pytest

from edgetrain import progress


class Clock:
    """A clock the test advances by hand (progress reads time only through it)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def log_task(total, clock, stream):
    return progress.Task("profiling m", total, mode="log", stream=stream, clock=clock)


def test_short_work_prints_nothing_off_a_terminal():
    stream, clock = io.StringIO(), Clock()
    work = log_task(10, clock, stream)
    for _ in range(10):
        clock.now += 0.1
        work()
    work.close()
    assert stream.getvalue() == ""


def test_long_work_logs_at_most_every_ten_percent_and_two_seconds():
    stream, clock = io.StringIO(), Clock()
    work = log_task(1000, clock, stream)
    for _ in range(1000):
        clock.now += 0.05  # 50 s in all
        work(detail="loss 1.0")
    work.close()
    lines = stream.getvalue().splitlines()
    # one line per 10 % once the task has run 2 s (from 4 % on), and a closing line
    assert 9 <= len(lines) <= 12, lines
    assert all(" edgetrain: profiling m: " in line for line in lines)
    assert "1000/1000 (100%)" in lines[-2]
    assert "done in 50.0 s (last: loss 1.0)" in lines[-1]


def test_slow_steps_are_logged_at_most_every_two_seconds():
    stream, clock = io.StringIO(), Clock()
    work = log_task(3, clock, stream)
    for _ in range(3):
        clock.now += 30
        work()
    work.close()
    lines = stream.getvalue().splitlines()
    assert [line.split("edgetrain: ")[1] for line in lines[:3]] == [
        "profiling m: 1/3 (33%), 30 s",
        "profiling m: 2/3 (66%), 60 s",
        "profiling m: 3/3 (100%), 90 s",
    ]


def test_quiet_and_environment_silence_everything(monkeypatch):
    stream = io.StringIO()
    with progress.quiet(), progress.task("x", total=1, stream=stream) as step:
        assert not step.active
        step()
        progress.note("hello", stream=stream)
    monkeypatch.setenv(progress.ENV, "0")
    progress.note("hello", stream=stream)
    assert stream.getvalue() == ""


def test_notes_are_timestamped_lines_off_a_terminal(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    stream = io.StringIO()
    progress.note("planning resnet18", stream=stream)
    line = stream.getvalue()
    assert line.endswith(" edgetrain: planning resnet18\n")
    assert line[2] == ":" and line[5] == ":"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("nested", [False, True])
def test_terminal_shows_a_bar_and_removes_it(monkeypatch, nested):
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    stream = Terminal()
    with progress.task("outer", total=2, stream=stream) as outer:
        assert outer._bar is not None
        if nested:
            with progress.task("inner", total=3, stream=stream) as inner:
                assert inner._bar is outer._bar
                inner(3)
        outer(2, detail="loss 2.5")
    assert progress._bars.progress is None  # the display stopped with the last task
    assert "outer" in stream.getvalue()


def test_log_mode_can_be_forced_on_a_terminal(monkeypatch):
    monkeypatch.setenv(progress.ENV, "log")
    stream = Terminal()
    with progress.task("x", total=1, stream=stream) as step:
        assert step._bar is None and step.active
