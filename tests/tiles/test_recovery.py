"""A board that drops out does not stop the training: the survivors re-tile the model, repeat the
interrupted step and end with the weights of a run that lost no board."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.tiles.budget import held_bytes
from edgetrain.tiles.comm import Comm
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.launch import Survivors, WorkerFailed, resume_point, run_local
from edgetrain.tiles.recovery import (
    Decision,
    decision_path,
    kept_plan,
    survivor_grid,
    take_state,
)
from edgetrain.tiles.step_start import StepStart
from edgetrain.tiles.worker import TileJob

pytestmark = pytest.mark.xdist_group("tiles")


def _job(grid: Grid, fault: tuple[str, int, int] | None, steps: int = 4) -> TileJob:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
        nn.MaxPool2d(2),
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
    )
    return TileJob(
        net,
        (24, 24),
        2,
        grid,
        ((0, 0), (1, 2)),
        steps=steps,
        dtype="float64",
        collect=True,
        fault=fault,
        measure_memory=False,
    )


def _reference(steps: int = 4) -> dict[str, np.ndarray]:
    (result,) = run_local([_job(Grid(1, 1), None, steps)])[0]
    return result.state


def _same_weights(state: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-10, err_msg=name)


def test_a_killed_board_is_dropped_and_the_survivor_ends_with_the_uninterrupted_weights():
    results = run_local([_job(Grid(1, 2), ("die", 1, 2))], timeout=30.0, recover=True)[0]
    assert len(results) == 1
    (survivor,) = results
    assert survivor.recoveries == [
        "board 1 was killed by SIGKILL during step 2; 1 continue on a 1x1 grid and repeat step 2"
    ]
    _same_weights(survivor.state, _reference())


def test_three_boards_lose_one_and_two_continue_on_a_retiled_grid():
    results = run_local([_job(Grid(1, 3), ("die", 0, 1))], timeout=30.0, recover=True)[0]
    assert [r.rank for r in results] == [0, 1]
    (line,) = results[0].recoveries
    assert line == (
        "board 0 was killed by SIGKILL during step 1; 2 continue on a 1x2 grid and repeat step 1"
    )
    _same_weights(results[0].state, _reference())


def test_a_hung_board_is_stopped_and_the_others_continue():
    results = run_local([_job(Grid(1, 2), ("hang", 0, 1), steps=3)], timeout=3.0, recover=True)[0]
    (survivor,) = results
    (line,) = survivor.recoveries
    assert line.startswith("board 0 stopped answering during step 1; 1 continue on a 1x1 grid")
    _same_weights(survivor.state, _reference(steps=3))


def test_an_error_in_a_boards_own_step_still_stops_the_run():
    with pytest.raises(WorkerFailed, match="injected fault on rank 1 at step 1"):
        run_local([_job(Grid(1, 2), ("raise", 1, 1))], timeout=30.0, recover=True)


def test_the_survivor_grid_keeps_the_shape_and_refuses_what_cannot_tile():
    job = _job(Grid(2, 2), None)
    assert survivor_grid(job, 2) in (Grid(1, 2), Grid(2, 1))
    assert survivor_grid(job, 1) == Grid(1, 1)
    tiny = TileJob(job.model, (4, 4), 1, Grid(2, 2), job.grouping)
    with pytest.raises(InvalidInput, match="no grid of 3 boards tiles this model"):
        survivor_grid(tiny, 3)


class _Residual(nn.Module):
    """A user's small residual CNN with a classifier head: trained through its captured graph."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = torch.relu(y + self.body(y))
        return self.head(y.mean(dim=(2, 3)))


def _graph_job(grid: Grid, fault: tuple[str, int, int] | None) -> TileJob:
    torch.manual_seed(0)
    return TileJob(
        _Residual(),
        (16, 16),
        2,
        grid,
        (),
        steps=3,
        dtype="float64",
        collect=True,
        fault=fault,
        measure_memory=False,
        cut=1_000,
    )


def test_a_graph_model_loses_a_board_and_ends_with_the_uninterrupted_weights():
    results = run_local([_graph_job(Grid(1, 3), ("die", 2, 1))], timeout=30.0, recover=True)[0]
    assert len(results) == 2
    assert results[0].recoveries[0].endswith("2 continue on a 1x2 grid and repeat step 1")
    (reference,) = run_local([_graph_job(Grid(1, 1), None)])[0]
    _same_weights(results[0].state, reference.state)


def test_survivors_resume_at_the_most_steps_one_completed_and_take_its_weights():
    assert resume_point([3, 3, 3]) == (3, None)
    assert resume_point([2, 3, 3]) == (3, 1)
    assert resume_point([3, 2]) == (3, 0)
    assert resume_point([0]) == (0, None)


def _two_ranks(tmp_path: Any, work: Any) -> list[Any]:
    """``work(comm)`` on two gloo ranks in threads of this process; their results."""
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            comm = Comm.from_file(str(tmp_path / "store"), r, 2, "127.0.0.1", 30.0)
            results[r] = work(r, comm)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60.0)
    assert not errors, errors
    return results


def test_a_survivor_behind_takes_the_weights_and_buffers_of_the_one_ahead(tmp_path):
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).double()
        model(torch.randn(2, 3, 8, 8, dtype=torch.float64))  # running statistics of its own
        return model

    ahead, behind = make(1), make(2)
    expected = {n: t.clone() for n, t in ahead.state_dict().items()}

    def work(r: int, comm: Comm) -> dict[str, torch.Tensor]:
        model = ahead if r == 0 else behind
        take_state(comm, model, source=0)
        return model.state_dict()

    for state in _two_ranks(tmp_path, work):
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(state[name], value), name


def test_a_failed_step_rewinds_the_buffers_only_when_it_had_begun():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    start = StepStart(step=5, buffers={n: b.clone() for n, b in model.named_buffers()})
    before = {n: b.clone() for n, b in model.named_buffers()}
    model(torch.randn(2, 3, 8, 8))  # the step's forward updates the running statistics
    after = {n: b.clone() for n, b in model.named_buffers()}
    start.rewind(model, completed=6)  # step 6 never began: step 5's update stays
    assert all(torch.equal(b, after[n]) for n, b in model.named_buffers())
    start.rewind(model, completed=5)  # step 5 began and failed: back to its start
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())


def test_a_board_holds_its_weights_once():
    """Every tensor a worker holds before its last step (the garbage collector's count) is its
    weights and buffers, once: no copy of the model it was sent, none kept for recovery."""
    torch.manual_seed(0)
    job = replace(_job(Grid(1, 2), None, steps=2), measure_memory=True, collect=False)
    for recover in (False, True):
        results = run_local([job], timeout=30.0, recover=recover)[0]
        held = held_bytes(job.model, torch.float64)
        assert [r.resident_bytes for r in results] == [held, held]


class _Exited:
    """A worker process as the launcher sees it: alive, or killed."""

    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode

    def kill(self) -> None:
        self.exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        return None

    def is_alive(self) -> bool:
        return self.exitcode is None


def test_survivors_a_step_apart_resume_where_one_got_to_and_take_its_weights(tmp_path):
    """Board 2 died while boards 0 and 1 were in its all-reduce: board 1's finished (3 steps
    completed), board 0's did not (2): they resume at step 3, board 0 taking board 1's weights."""
    import queue

    job = _job(Grid(1, 3), None)
    processes = [_Exited(None), _Exited(None), _Exited(-9)]
    inbox: queue.Queue[Any] = queue.Queue()
    watcher = Survivors(job, processes, inbox, str(tmp_path), 30.0, 60.0, kept_plan(job))
    inbox.put(("lost", 0, 0, (2, "RuntimeError: Connection closed by peer", True)))
    inbox.put(("lost", 1, 0, (3, "RuntimeError: Connection closed by peer", True)))
    watcher._receive()
    watcher._receive()
    watcher.since = time.monotonic()
    watcher._maybe_decide({2: -9})
    decision = Decision.from_json(decision_path(str(tmp_path), 1).read_text())
    assert (decision.members, decision.resume_step, decision.source) == ((0, 1), 3, 1)
    assert watcher.lines == [
        "board 2 was killed by SIGKILL during step 3; 2 continue on a 1x2 grid and repeat "
        "step 3 (board 0 takes board 1's weights)"
    ]
