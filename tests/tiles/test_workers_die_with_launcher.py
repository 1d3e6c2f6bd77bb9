"""Local tile workers end with their launcher, however it ends: no orphan keeps training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

_LAUNCHER = textwrap.dedent(
    """
    import torch
    from torch import nn
    from edgetrain.tiles.launch import run_local
    from edgetrain.tiles.grid import Grid
    from edgetrain.tiles.worker import TileJob

    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()))
    job = TileJob(net, (16, 16), 1, Grid(1, 2), ((0, 0),), steps=10**7, measure_memory=False)
    run_local([job], timeout=60.0)
    """
)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start_launcher(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[psutil.Process]]:
    """A launcher whose two workers have met (their rendezvous file exists), and every process
    it started (the workers and multiprocessing's resource tracker)."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], env=env)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("edgetrain-tiles-*/store")):
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            pytest.fail("the launcher's workers never met")
        time.sleep(0.2)
    time.sleep(1.0)  # both ranks past their start-up, training
    children = psutil.Process(launcher.pid).children(recursive=True)
    assert len(children) >= 2
    return launcher, children


def _survivors(children: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(c) for c in children):
            return []
        time.sleep(0.2)
    left = [c for c in children if _alive(c)]
    for child in left:  # do not leave them training after a failed test
        child.kill()
    return left


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_workers_and_tracker_end_when_the_launcher_is_killed(tmp_path, signum):
    launcher, children = _start_launcher(tmp_path)
    launcher.send_signal(signum)
    code = launcher.wait(timeout=30)
    assert code in (-signum, 128 + signum)
    assert _survivors(children, 15.0) == []


def test_sigterm_stops_the_workers_and_removes_the_launch_directory(tmp_path):
    launcher, children = _start_launcher(tmp_path)
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(timeout=30)
    assert _survivors(children, 15.0) == []
    assert code == 143
    assert list(tmp_path.glob("edgetrain-tiles-*")) == []
