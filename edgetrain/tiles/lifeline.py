"""A local worker dies with the process that started it.

The launcher of ``edgetrain tiles`` may be stopped in ways that run none of its clean-up: a
SIGKILL, or a SIGTERM while Python's default handler is in place. Its workers must not carry on
training as orphans. :func:`die_with_parent` is the first thing a worker does: on Linux it asks
the kernel for a SIGKILL when its parent exits (``prctl(PR_SET_PDEATHSIG)``), and on every
system a watchdog thread checks the parent's pid twice a second and kills the worker when the
parent is gone (its ``getppid()`` changes: it was re-parented).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal this process gets when its parent exits (linux/prctl.h)."""

WATCHDOG_SECONDS = 0.5
"""How often the watchdog thread checks that the parent is alive."""


def die_with_parent(parent_pid: int) -> None:
    """Make this process end (SIGKILL) when ``parent_pid``, its parent, exits; at once if it has
    already gone."""
    if sys.platform.startswith("linux"):
        _parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        _die()
    watchdog = threading.Thread(
        target=_watch, args=(parent_pid,), name="edgetrain-parent-watchdog", daemon=True
    )
    watchdog.start()


def _parent_death_signal(signum: int) -> None:
    """``prctl(PR_SET_PDEATHSIG, signum)``; silently nothing where libc lacks it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the watchdog thread still covers it


def _watch(parent_pid: int) -> None:
    event = threading.Event()
    while not event.wait(WATCHDOG_SECONDS):
        if os.getppid() != parent_pid:
            _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
