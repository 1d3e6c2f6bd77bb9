"""A board that drops out does not stop the training: the survivors re-tile the model, repeat the
interrupted step and end with the weights of a run that lost no board."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.launch import WorkerFailed, run_local
from edgetrain.tiles.recovery import survivor_grid
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
