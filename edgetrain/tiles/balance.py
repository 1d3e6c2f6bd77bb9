"""Tile sizes for boards that differ: row and column shares that balance the ranks' compute (pure).

Rank ``r`` in grid row ``i`` and column ``j`` computes about ``h_i * w_j`` of every tiled map,
``h_i`` the share of the height its grid row takes and ``w_j`` the share of the width its column
takes. On a board of speed ``s_r`` that takes ``h_i * w_j / s_r``; the step waits for the slowest
rank. :func:`speed_shares` finds the shares that make the slowest rank least under that model
(alternating: each row's height share inversely to the slowest time along it, then each column's
width share likewise; on a 1 x n or n x 1 grid the shares are the speeds). Halos, tails on every
rank and whole pixels make the true times differ from the model's, so :func:`balance` then moves
the boundaries a pixel fraction at a time as long as the cost model's slowest rank gets faster.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from edgetrain.errors import InvalidInput
from edgetrain.tiles.grid import Grid

RankSeconds = Callable[[Grid], Sequence[float]]
"""The cost model's compute seconds of every rank on a grid with given shares."""


def speed_shares(grid: Grid, speeds: Sequence[float], rounds: int = 200) -> Grid:
    """``grid`` with the shares that balance ``h_i * w_j / speeds[r]`` over the ranks."""
    if len(speeds) != grid.size:
        raise InvalidInput(
            f"the profile lists {len(speeds)} boards but grid {grid} has {grid.size} tiles; "
            f"give a grid of {len(speeds)} tiles (e.g. 1x{len(speeds)}) or list {grid.size} boards"
        )
    speed = [[speeds[i * grid.cols + j] for j in range(grid.cols)] for i in range(grid.rows)]
    rows = [1.0 / grid.rows] * grid.rows
    cols = [1.0 / grid.cols] * grid.cols
    for _ in range(rounds):
        rows = _normal(
            [1.0 / max(cols[j] / speed[i][j] for j in range(grid.cols)) for i in range(grid.rows)]
        )
        cols = _normal(
            [1.0 / max(rows[i] / speed[i][j] for i in range(grid.rows)) for j in range(grid.cols)]
        )
    return grid.with_shares(rows, cols)


def _normal(values: list[float]) -> list[float]:
    total = sum(values)
    return [v / total for v in values]


def _bounds(shares: Sequence[float]) -> list[float]:
    out, running = [], 0.0
    for share in shares[:-1]:
        running += share
        out.append(running)
    return out


def _shares(bounds: Sequence[float]) -> list[float]:
    edges = [0.0, *bounds, 1.0]
    return [b - a for a, b in itertools.pairwise(edges)]


def balance(grid: Grid, speeds: Sequence[float], seconds: RankSeconds, resolution: int) -> Grid:
    """Shares for ``grid`` whose slowest rank by ``seconds`` is least: :func:`speed_shares`, then
    boundary moves of ``1 / resolution`` (a pixel of the largest map) and multiples, kept while
    the slowest rank gets faster."""
    best = speed_shares(grid, speeds)
    best_time = max(seconds(best))
    steps = [d / resolution for d in (16, 8, 4, 2, 1)]
    improved = True
    while improved:
        improved = False
        for axis in (0, 1):
            shares = best.row_shares if axis == 0 else best.col_shares
            for k in range(len(shares) - 1):
                for step in steps:
                    for sign in (1, -1):
                        bounds = _bounds(shares)
                        bounds[k] += sign * step
                        low = bounds[k - 1] if k else 0.0
                        high = bounds[k + 1] if k + 1 < len(bounds) else 1.0
                        if not low < bounds[k] < high:
                            continue
                        new = _shares(bounds)
                        trial = (
                            best.with_shares(new, best.col_shares)
                            if axis == 0
                            else best.with_shares(best.row_shares, new)
                        )
                        try:
                            time = max(seconds(trial))
                        except InvalidInput:  # a tile of no pixels
                            continue
                        if time < best_time * (1 - 1e-9):
                            best, best_time, improved = trial, time, True
                            shares = best.row_shares if axis == 0 else best.col_shares
    return best
