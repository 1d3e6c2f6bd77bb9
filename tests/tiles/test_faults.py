"""A worker that dies, hangs or fails stops the run with one clear line, within bounded time."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from edgetrain.errors import EdgetrainError
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.launch import WorkerFailed, run_local
from edgetrain.tiles.worker import TileJob


def _job(fault: tuple[str, int, int]) -> TileJob:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
        nn.MaxPool2d(2),
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
    )
    return TileJob(
        net, (16, 16), 1, Grid(1, 2), ((0, 0), (1, 2)), steps=3, fault=fault, measure_memory=False
    )


def _fails(fault: tuple[str, int, int], timeout: float) -> tuple[str, float]:
    began = time.monotonic()
    with pytest.raises(WorkerFailed) as caught:
        run_local([_job(fault)], timeout=timeout, progress_timeout=60.0)
    message = str(caught.value)
    assert "\n" not in message
    return message, time.monotonic() - began


def test_a_killed_worker_stops_the_others_and_names_the_rank():
    message, seconds = _fails(("die", 1, 1), timeout=30.0)
    assert message == "worker rank 1 was killed by SIGKILL; stopped the other 1"
    assert seconds < 25  # start-up plus a step: nobody waits for the gloo timeout


def test_a_hung_worker_is_found_by_the_gloo_timeout():
    message, seconds = _fails(("hang", 1, 1), timeout=3.0)
    assert message.startswith("worker rank 1 stopped responding (hung?); rank 0 reported")
    assert "stopped all 2" in message
    assert seconds < 25  # start-up, a step, the 3 s timeout and the stop


def test_an_exception_in_a_worker_is_reported_with_its_message():
    message, _ = _fails(("raise", 0, 0), timeout=30.0)
    assert message == (
        "worker rank 0 failed: RuntimeError: injected fault on rank 0 at step 0; "
        "stopped the other 1"
    )


def test_worker_failure_is_a_user_facing_error():
    assert issubclass(WorkerFailed, EdgetrainError)
