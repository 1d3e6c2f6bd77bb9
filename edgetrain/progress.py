"""Progress of work that can take more than a couple of seconds, shown on stderr.

The whole API::

    from edgetrain import progress

    with progress.task("profiling resnet101", total=35) as step:
        for stage in stages:
            ...
            step()                          # one unit done; step(3), step(detail="loss 6.91")
    progress.note("planning resnet101 within 2.00 GiB")   # one line, now
    with progress.quiet():                  # nothing shown inside (nestable)
        ...

How it looks:

* stderr is a terminal: a rich progress bar per open task (nested tasks stack), removed when the
  task ends; notes are printed as dim lines above the bars.
* stderr is not a terminal (a log, a pipe, CI): plain lines ``HH:MM:SS edgetrain: <text>``. A task
  is announced only once it has run for :data:`LOG_AFTER_SECONDS` (short work prints nothing),
  then a line at most every :data:`LOG_EVERY_SECONDS` and only when it has advanced another 10 %
  of a known total (a task without a total: every :data:`LOG_UNKNOWN_EVERY_SECONDS`), and a last
  line with its duration. Notes are always printed.
* Silenced by :func:`quiet` or the environment variable ``EDGETRAIN_PROGRESS=0`` (``off``,
  ``false``, ``no`` also work); ``EDGETRAIN_PROGRESS=log`` forces the plain lines on a terminal.

Cost when nobody listens: a silenced task's ``step()`` is one attribute test. Progress never
writes to stdout, so ``--json`` output stays one clean document. Not thread-safe: report from the
thread that opened the task.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

LOG_AFTER_SECONDS = 2.0
"""Off a terminal, a task prints its first line once it has run this long."""

LOG_EVERY_SECONDS = 2.0
"""Off a terminal, at most one line per task in this many seconds."""

LOG_UNKNOWN_EVERY_SECONDS = 10.0
"""Off a terminal, a task without a total prints a line at most this often."""

ENV = "EDGETRAIN_PROGRESS"
"""Environment variable: ``0``/``off`` silences progress, ``log`` forces plain lines."""

_quiet_depth = 0


@contextmanager
def quiet() -> Iterator[None]:
    """Show no progress inside this block (tasks and notes become no-ops)."""
    global _quiet_depth
    _quiet_depth += 1
    try:
        yield
    finally:
        _quiet_depth -= 1


def _mode(stream: IO[str]) -> str:
    """``"off"``, ``"log"`` or ``"bar"`` for this stream, after quiet() and the environment."""
    if _quiet_depth > 0:
        return "off"
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in {"0", "off", "false", "no", "quiet"}:
        return "off"
    if setting == "log":
        return "log"
    isatty = getattr(stream, "isatty", None)
    try:
        terminal = bool(isatty()) if isatty is not None else False
    except ValueError:  # a closed stream
        return "off"
    return "bar" if terminal and os.environ.get("TERM") != "dumb" else "log"


class Task:
    """One piece of work with an optional number of units; call it to report units done."""

    def __init__(
        self,
        description: str,
        total: int | None,
        *,
        mode: str,
        stream: IO[str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.description = description
        self.total = total
        self.completed = 0
        self.detail = ""
        self.active = mode != "off"
        self._mode = mode
        self._stream = stream
        self._clock = clock
        self._start = clock()
        self._last_line: float | None = None
        self._last_decile = 0
        self._bar: Any = None
        self._bar_id: Any = None
        if mode == "bar":
            self._bar, self._bar_id = _bars.add(description, total, stream)

    def __call__(self, advance: int = 1, *, detail: str | None = None) -> None:
        """``advance`` more units are done; ``detail`` (e.g. ``"loss 6.91"``) is shown beside."""
        if not self.active:
            return
        self.completed += advance
        if detail is not None:
            self.detail = detail
        if self._bar is not None:
            self._bar.update(self._bar_id, completed=self.completed, detail=self.detail)
        else:
            self._maybe_log()

    def _maybe_log(self) -> None:
        now = self._clock()
        if now - self._start < LOG_AFTER_SECONDS:
            return
        if self._last_line is not None and now - self._last_line < LOG_EVERY_SECONDS:
            return
        if self.total:
            decile = min(10, 10 * self.completed // self.total)
            if self._last_line is not None and decile <= self._last_decile:
                return
            self._last_decile = decile
        elif self._last_line is not None and now - self._last_line < LOG_UNKNOWN_EVERY_SECONDS:
            return
        self._last_line = now
        self._log(self._status(now))

    def _status(self, now: float) -> str:
        done = f"{self.completed}/{self.total}" if self.total else f"{self.completed}"
        percent = f" ({100 * self.completed // self.total}%)" if self.total else ""
        detail = f", {self.detail}" if self.detail else ""
        return f"{self.description}: {done}{percent}{detail}, {now - self._start:.0f} s"

    def _log(self, text: str) -> None:
        _write_line(self._stream, text)

    def close(self, *, stopped: bool = False) -> None:
        """End the task: remove its bar, or log its duration if it logged anything. ``stopped``
        (an exception or an interrupt ended it): say "stopped", never "done", on a terminal
        too, with how far it came."""
        if not self.active:
            return
        self.active = False
        seconds = self._clock() - self._start
        if stopped:
            done = f"{self.completed}/{self.total}" if self.total else f"{self.completed}"
            text = f"{self.description}: stopped at {done} after {seconds:.1f} s"
            if self._bar is not None:
                _bars.remove(self._bar_id)
                note(text, stream=self._stream)
            elif self._last_line is not None:
                self._log(text)
            return
        if self._bar is not None:
            _bars.remove(self._bar_id)
        elif self._last_line is not None:
            last = f" (last: {self.detail})" if self.detail else ""
            self._log(f"{self.description}: done in {seconds:.1f} s{last}")


def _write_line(stream: IO[str], text: str) -> None:
    stream.write(f"{time.strftime('%H:%M:%S')} edgetrain: {text}\n")
    stream.flush()


class _Bars:
    """The one rich progress display shared by every open task on a terminal."""

    def __init__(self) -> None:
        self.progress: Any = None
        self.open = 0

    def add(self, description: str, total: int | None, stream: IO[str]) -> tuple[Any, Any]:
        if self.progress is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=stream),
                transient=True,
            )
            self.progress.start()
        self.open += 1
        return self.progress, self.progress.add_task(description, total=total, detail="")

    def remove(self, task_id: Any) -> None:
        self.progress.remove_task(task_id)
        self.open -= 1
        if self.open == 0:
            self.progress.stop()
            self.progress = None

    def print(self, text: str) -> bool:
        """Print ``text`` above the bars when a display is live; False when none is."""
        if self.progress is None:
            return False
        self.progress.console.print(text, style="dim", markup=False, highlight=False)
        return True


_bars = _Bars()


@contextmanager
def task(
    description: str, total: int | None = None, *, stream: IO[str] | None = None
) -> Iterator[Task]:
    """Open a task (see the module docstring); yields the callable that reports progress.

    ``stream`` defaults to ``sys.stderr`` at the time of the call.
    """
    out = sys.stderr if stream is None else stream
    current = Task(description, total, mode=_mode(out), stream=out)
    try:
        yield current
    except BaseException:
        current.close(stopped=True)
        raise
    current.close()


def note(text: str, *, stream: IO[str] | None = None) -> None:
    """Print one line of progress now (a phase that has no steps: "planning ...")."""
    out = sys.stderr if stream is None else stream
    mode = _mode(out)
    if mode == "off":
        return
    if mode == "bar":
        if not _bars.print(text):
            from rich.console import Console

            Console(file=out).print(text, style="dim", markup=False, highlight=False)
        return
    _write_line(out, text)
