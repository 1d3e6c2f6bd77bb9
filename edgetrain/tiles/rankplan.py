"""Which stretches of one rank's step to recompute under a memory budget (pure, no torch).

A rank's step is a sequence of *units* that can each be recomputed: a layer inside a fused group
of a chain model (after the group's halo exchange), or a stretch of a graph model's operations
between two points where one value alone is live (a residual block of the replicated tail).
A unit either keeps what its backward needs (stored) or runs under a checkpoint: it keeps only
its input and runs its forward again when the backward reaches it, so no unit that communicates
with other ranks (a halo exchange, a gather, a sum over tiles) is ever one.

Checkpointing a set ``S`` of units saves about ``sum(saved_bytes)`` of the rank's peak and costs
``sum(recompute_seconds)``: the least-time ``S`` that saves at least ``need`` bytes is a 0/1
knapsack, solved exactly by dynamic programming on a grid of byte cells (:func:`cheapest_saving`).
The savings are estimates from the geometry; the rank's true peak is measured (``peak_of``, the
rank's own step counted under a dry communicator), and :func:`plan_rank` raises the need by the
overshoot until the measured peak fits the budget or every unit is checkpointed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from edgetrain.tiles.tiling import TilePlan

CELLS = 1024  # byte cells of the knapsack: savings are rounded down to total / CELLS


@dataclass(frozen=True)
class Unit:
    """A stretch of a rank's step that may be recomputed: ``index`` names it (a layer of a chain
    model, the first operation of a graph model's stretch), ``saved_bytes`` is what storing
    only its input saves, ``recompute_seconds`` what its second forward costs."""

    index: int
    saved_bytes: int
    recompute_seconds: float


@dataclass(frozen=True)
class RankPlan:
    """The units a rank recomputes, its measured peak with them, and their predicted extra time."""

    recompute: frozenset[int]
    peak_bytes: int
    recompute_seconds: float


def cheapest_saving(
    units: Sequence[Unit], need_bytes: int, cells: int = CELLS
) -> frozenset[int] | None:
    """The set of unit indices of least total ``recompute_seconds`` whose ``saved_bytes`` add up
    to at least ``need_bytes`` (each rounded down to a cell, so the sum is a lower bound), or
    None when even all of them save less."""
    if need_bytes <= 0:
        return frozenset()
    total = sum(u.saved_bytes for u in units)
    if total < need_bytes:
        return None
    cell = max(1, -(-total // cells))
    need = -(-need_bytes // cell)
    sizes = [u.saved_bytes // cell for u in units]
    if sum(sizes) < need:
        return None
    inf = float("inf")
    # best[k][c]: least seconds of a subset of the first k units saving >= c cells (c capped)
    best = [[0.0] + [inf] * need]
    for unit, size in zip(units, sizes, strict=True):
        row = list(best[-1])
        for c in range(need, 0, -1):
            value = best[-1][max(0, c - size)] + unit.recompute_seconds
            if size and value < row[c]:
                row[c] = value
        best.append(row)
    chosen: list[int] = []
    c = need
    for k in range(len(units), 0, -1):
        if best[k][c] != best[k - 1][c]:
            chosen.append(units[k - 1].index)
            c = max(0, c - sizes[k - 1])
    return frozenset(chosen)


def plan_rank(
    units: Sequence[Unit], peak_of: Callable[[frozenset[int]], int], budget_bytes: int
) -> RankPlan:
    """The least-time set of units to recompute whose measured peak (``peak_of``) fits
    ``budget_bytes``; when none does, the plan recomputing every unit (its peak above the
    budget: the least this rank can do)."""
    seconds = {u.index: u.recompute_seconds for u in units}

    def made(chosen: frozenset[int], peak: int) -> RankPlan:
        return RankPlan(chosen, peak, sum(seconds[i] for i in chosen))

    peak = peak_of(frozenset())
    if peak <= budget_bytes:
        return made(frozenset(), peak)
    everything = frozenset(seconds)
    need = peak - budget_bytes
    tried: set[frozenset[int]] = {frozenset()}
    step = max(1, sum(u.saved_bytes for u in units) // CELLS)
    while True:
        chosen = cheapest_saving(units, need)
        while chosen is not None and chosen in tried:  # rounding gave a set already measured
            need += step
            chosen = cheapest_saving(units, need)
        chosen = everything if chosen is None else chosen
        tried.add(chosen)
        peak = peak_of(chosen)
        if peak <= budget_bytes or chosen == everything:
            return made(chosen, peak)
        need += max(peak - budget_bytes, step)


def chain_units(
    tiles: TilePlan, rank: int, batch: int, element_bytes: int, macs_per_second: float
) -> tuple[Unit, ...]:
    """The layers of a chain model's fused groups on ``rank``: recomputing one keeps its input
    (the window's, which it keeps anyway) and saves its element-wise outputs (a batch norm's
    input and an activation's input are each one map of the layer's output)."""
    units = []
    for group in tiles.groups:
        for step, index in enumerate(group.layers):
            layer = tiles.network.layers[index]
            region = group.computed(step + 1, rank)
            maps = (1 if layer.kind != "pointwise" else 0) + (1 if layer.batchnorm else 0)
            saved = maps * region.area * layer.out_channels * batch * element_bytes
            macs = layer.macs_per_pixel * region.area * batch
            units.append(Unit(index, saved, macs / macs_per_second))
    return tuple(units)


@dataclass(frozen=True)
class Operation:
    """One operation of a graph model as recomputation sees it: its ``name``, the names it
    ``reads``, whether a layer starts with it (a window), and whether it is ``local`` (it
    issues no communication: no halo exchange, gather or sum over tiles)."""

    name: str
    reads: tuple[str, ...]
    starts_layer: bool
    local: bool


@dataclass(frozen=True)
class Stretch:
    """Operations ``start .. stop - 1`` that read one value computed before them (``source``)
    and leave one value read after them (``result``)."""

    start: int
    stop: int
    source: str
    result: str


def stretches(operations: Sequence[Operation]) -> tuple[Stretch, ...]:
    """The stretches of ``operations`` a rank may recompute: between consecutive points where
    one value alone is live and a layer starts (a residual block, a stem), every operation
    local, at least two of them, their result computed inside."""
    uses = [(op.name, op.reads) for op in operations]
    last_use: dict[str, int] = {}
    for position, (_, reads) in enumerate(uses):
        for name in reads:
            last_use[name] = position
    live_at: dict[int, str] = {}
    live: set[str] = set()
    for position, (name, _) in enumerate(uses):
        live = {n for n in live if last_use.get(n, -1) >= position}
        if len(live) == 1:
            live_at[position] = next(iter(live))
        live.add(name)
    bounds = [
        p
        for p in sorted(live_at)
        if operations[p].starts_layer or not operations[p - 1].local or not operations[p].local
    ]
    found = []
    for start, stop in itertools.pairwise(bounds):
        inside = {op.name for op in operations[start:stop]}
        result = live_at[stop]
        local = all(op.local for op in operations[start:stop])
        if local and stop - start >= 2 and result in inside:
            found.append(Stretch(start, stop, live_at[start], result))
    return tuple(found)
