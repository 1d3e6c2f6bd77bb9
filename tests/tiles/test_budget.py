"""Per-board memory: each rank's predicted peak equals its measured one, and ``--memory``
chooses a grid every board fits or refuses in one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from edgetrain.cli.main import cli
from edgetrain.errors import InvalidInput
from edgetrain.models import build
from edgetrain.tiles.budget import Candidate, fit_budget, grids_of, held_bytes, predict_ranks
from edgetrain.tiles.graph import analyse
from edgetrain.tiles.grid import Grid, parse_groups
from edgetrain.tiles.launch import run_local
from edgetrain.tiles.worker import DTYPES, TileJob
from edgetrain.units import format_bytes
from tests.tiles.heap_beyond import HEAP_BEYOND_BYTES


def _tiles(text: str):
    return CliRunner().invoke(cli, ["tiles", *text.split()])


def _jobs() -> list[TileJob]:
    torch.manual_seed(0)
    chain = build("yolov2-16")
    resnet = build("resnet18")
    operations = len(analyse(resnet, torch.zeros(2, 3, 48, 48))[1])
    grid = Grid(1, 2)
    return [
        TileJob(chain, (64, 80), 1, grid, parse_groups("0-3,4-7,8-15", len(chain)), steps=2),
        TileJob(
            chain,
            (67, 67),
            1,
            grid,
            parse_groups("per-layer", len(chain)),
            steps=2,
            dtype="float64",
        ),
        TileJob(resnet, (48, 48), 2, grid, (), steps=2, cut=operations),  # every map tiled
    ]


def test_each_ranks_predicted_peak_is_its_measured_peak_within_five_percent():
    jobs = _jobs()
    predicted = [predict_ranks(job) for job in jobs]
    measured = run_local(jobs, timeout=120.0)
    for job, memories, results in zip(jobs, predicted, measured, strict=True):
        held = held_bytes(job.model, DTYPES[job.dtype])
        for memory, result in zip(memories, results, strict=True):
            assert memory.held_bytes == held
            board = held + result.peak_bytes
            assert abs(board - memory.tensor_peak_bytes) <= 0.05 * board, (job.image, memory)
            assert memory.peak_bytes == memory.tensor_peak_bytes + memory.scratch_bytes
            # The heap the step took (tensors, kernel scratch, what neither holds; sampled)
            # within the prediction that counts the first two, and what neither holds.
            if result.heap_peak_bytes is not None:
                limit = memory.peak_bytes - held + HEAP_BEYOND_BYTES
                assert result.heap_peak_bytes <= limit, (job.image, memory, result.heap_peak_bytes)


def test_grids_of_lists_every_grid_of_the_boards_squarest_first():
    assert grids_of(4) == (Grid(2, 2), Grid(1, 4), Grid(4, 1))
    assert grids_of(6) == (Grid(2, 3), Grid(3, 2), Grid(1, 6), Grid(6, 1))
    assert grids_of(1) == (Grid(1, 1),)


def test_fit_budget_takes_the_fastest_fitting_candidate_and_refuses_naming_the_least():
    chain = build("yolov2-16")
    groups = parse_groups("1", len(chain))
    small = TileJob(chain, (32, 32), 1, Grid(1, 1), groups)
    large = TileJob(chain, (64, 64), 1, Grid(1, 1), groups)
    need_small = predict_ranks(small)[0].peak_bytes
    need_large = predict_ranks(large)[0].peak_bytes
    assert need_small < need_large
    first = Candidate(large, 1.0, "large")
    others = [Candidate(small, 3.0, "small slow"), Candidate(small, 2.0, "small fast")]
    fitted = fit_budget(first, lambda: iter(others), need_small, 1, format_bytes)
    assert fitted.candidate.label == "small fast"
    assert fit_budget(first, lambda: iter(others), need_large, 1, format_bytes).candidate is first
    with pytest.raises(InvalidInput, match=f"give --memory {need_small} or more"):
        fit_budget(first, lambda: iter(others), need_small - 1, 1, format_bytes)


def test_memory_option_keeps_every_measured_board_peak_within_the_budget():
    result = _tiles("--grid 1x2 --image 96 --steps 2 --memory 40MB --json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["memory"]["budget_bytes"] == 40_000_000
    for rank in doc["ranks"]:
        assert rank["board_peak_bytes"] <= 40_000_000
        assert (rank["board_heap_peak_bytes"] or 0) <= 40_000_000 + HEAP_BEYOND_BYTES
        assert rank["predicted_board_heap_bytes"] <= 40_000_000
        assert abs(rank["board_peak_bytes"] - rank["predicted_board_peak_bytes"]) <= (
            0.05 * rank["board_peak_bytes"]
        )


def test_memory_no_grid_fits_is_one_line_exit_2_naming_what_would():
    result = _tiles("--grid 1x2 --image 64 --memory 20MB")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "no grid of 2 boards trains in 19.07 MiB per board" in lines[0]
    assert "give --memory" in lines[0]
