"""``edgetrain tiles`` starts at most MAX_LOCAL_WORKERS workers and no more threads than cores."""

from __future__ import annotations

import psutil
import pytest
from click.testing import CliRunner
from torch import nn

from edgetrain.cli.main import cli
from edgetrain.cli.options import usable_cores
from edgetrain.errors import InvalidInput
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.launch import MAX_LOCAL_WORKERS, run_local
from edgetrain.tiles.worker import TileJob


def _refused(*args: str) -> str:
    result = CliRunner().invoke(cli, ["tiles", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize("grid", ["64x64", "17x1", "5x4"])
def test_a_grid_of_more_tiles_than_the_local_cap_is_refused_in_one_line(grid):
    rows, cols = map(int, grid.split("x"))
    line = _refused("--grid", grid, "--steps", "1")
    assert f"grid {grid} needs {rows * cols} local workers" in line
    assert f"more than the {MAX_LOCAL_WORKERS} one machine runs" in line
    assert "torchrun" in line


def test_run_local_refuses_before_starting_a_process():
    net = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()))
    job = TileJob(net, (64, 64), 1, Grid(17, 1), ((0, 0),), measure_memory=False)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(InvalidInput, match="17 local workers, more than the 16"):
        run_local([job])
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before


@pytest.mark.parametrize("threads", ["100000", str(2**63), "cores+1"])
def test_threads_beyond_the_cores_are_refused_in_one_line(threads):
    cores = usable_cores()
    if threads == "cores+1":
        threads = str(cores + 1)
    line = _refused("--threads", threads, "--grid", "1x2", "--image", "32")
    assert f"{threads} threads is more than the {cores} cores" in line
    assert f"give at most {cores}" in line


def test_usable_cores_is_the_affinity_of_this_process():
    assert usable_cores() == len(psutil.Process().cpu_affinity())
