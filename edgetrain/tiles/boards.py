"""Tiles for boards that differ in speed and memory (torch side: each rank's peak is predicted by
running its step).

The grid's row and column shares start from the boards' speeds and are moved while the cost
model's slowest rank gets faster (:func:`edgetrain.tiles.balance.balance`); every rank's peak is
then predicted (:func:`edgetrain.tiles.budget.predict_ranks`). A rank over its board's memory is
balanced again as if its board were slower, in proportion to how far over it is, until every rank
fits; else one line names the board and what it would need. ``torchrun`` workers balance
their tiles with :func:`edgetrain.tiles.boardcost.balanced_job` alone (every board that reads the
same profile computes the same shares, so they agree without talking).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from edgetrain.devices.cluster import Cluster
from edgetrain.errors import InvalidInput
from edgetrain.tiles.balance import balance, speed_shares
from edgetrain.tiles.budget import RankMemory, predict_ranks
from edgetrain.tiles.grid import Grid
from edgetrain.units import format_bytes

ATTEMPTS = 8
"""Times the shares are balanced again for ranks over their board's memory."""


def _slower(cluster: Cluster, factors: list[float]) -> Cluster:
    """``cluster`` with board ``r``'s speed multiplied by ``factors[r]``."""
    boards = tuple(
        replace(b, core_macs_per_second=b.core_macs_per_second * f)
        for b, f in zip(cluster.boards, factors, strict=True)
    )
    return replace(cluster, boards=boards)


@dataclass(frozen=True)
class BoardFit:
    """The job chosen for boards that differ: its grid's shares, ``extra`` (what ``make`` gave
    with it), every rank's predicted memory and compute seconds on its own board."""

    job: Any
    extra: Any
    ranks: tuple[RankMemory, ...]
    compute_seconds: tuple[float, ...]


def fit_boards(
    grid: Grid,
    cluster: Cluster,
    resolution: int,
    seconds_for: Callable[[Cluster], Any],
    make: Callable[[Grid], tuple[Any, Any]],
    places: Sequence[int] = (),
) -> BoardFit:
    """Shares of ``grid`` balanced for ``cluster``'s boards (``seconds_for`` of a cluster gives
    the per-rank compute seconds on a grid; ``resolution`` pixels across the largest map) with
    every rank's predicted peak within its board's memory; ``make`` builds the job (and any
    ``extra``) of a grid. InvalidInput, naming the board by its place in the profile
    (``places[rank]``; by default its rank), when a board cannot fit."""
    number = places or range(grid.size)
    factors = [1.0] * grid.size
    over: list[RankMemory] = []
    for _ in range(ATTEMPTS):
        slower = _slower(cluster, factors)
        speeds = [b.macs_per_second for b in slower.boards]
        shares = balance(grid, speeds, seconds_for(slower), resolution)
        job, extra = make(shares)
        ranks = predict_ranks(job)
        over = [m for m in ranks if m.peak_bytes > cluster.board(m.rank).memory_bytes]
        if not over:
            seconds = tuple(seconds_for(cluster)(shares))
            return BoardFit(job, extra, ranks, seconds)
        for memory in over:
            board = cluster.board(memory.rank)
            if memory.held_bytes >= board.memory_bytes:
                raise InvalidInput(
                    f"board {number[memory.rank]} ({board.name}) has "
                    f"{format_bytes(board.memory_bytes)} "
                    f"but the model's weights and buffers alone take "
                    f"{format_bytes(memory.held_bytes)}; give it more memory or leave it out"
                )
            room = (
                board.memory_bytes - memory.held_bytes - memory.scratch_bytes
            ) / memory.step_peak_bytes
            factors[memory.rank] *= max(0.25, 0.95 * room)
    worst = max(over, key=lambda m: m.peak_bytes / cluster.board(m.rank).memory_bytes)
    board = cluster.board(worst.rank)
    raise InvalidInput(
        f"board {number[worst.rank]} ({board.name}) has {format_bytes(board.memory_bytes)} but its "
        f"smallest tile found needs {format_bytes(worst.peak_bytes)} ({worst.peak_bytes:,} "
        f"bytes); give it more memory in the profile, a larger grid or a smaller image or batch"
    )


def start_shares(grid: Grid, cluster: Cluster) -> Grid:
    """``grid`` with shares in proportion to the boards' speeds (the search's start)."""
    return speed_shares(grid, [b.macs_per_second for b in cluster.boards])
