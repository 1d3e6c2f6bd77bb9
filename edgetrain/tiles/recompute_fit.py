"""Grid, grouping (or cut) and each rank's recomputation chosen together for a budget (torch).

For every candidate whose stored activations do not fit (fastest first), each rank's least
memory is predicted with every unit it may recompute recomputed; a candidate some rank cannot
fit even so is out, and the least of those peaks is what the refusal names. For the others each
rank's least-time plan within the budget (:func:`~edgetrain.tiles.rankplan.plan_rank`) is found
against its predicted peak, the rank's own step counted under a dry communicator, so every
rank's measured peak is its prediction. The candidate's step time is the cost model's plus the
slowest rank's recomputation; a candidate whose time without recomputation is already no faster
than the best found is not planned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from edgetrain.tiles.budget import Fitted, predict_rank
from edgetrain.tiles.rankplan import RankPlan, Unit, plan_rank


def _with(job: Any, rank: int, recompute: frozenset[int]) -> Any:
    plans = tuple(recompute if r == rank else frozenset() for r in range(job.grid.size))
    return replace(job, recompute=plans)


def _peaks(job: Any, rank: int, known: dict[frozenset[int], int]) -> Callable[..., int]:
    def peak_of(recompute: frozenset[int]) -> int:
        if recompute not in known:
            known[recompute] = predict_rank(_with(job, rank, recompute), rank).peak_bytes
        return known[recompute]

    return peak_of


def _planned(fitted: Fitted, plans: Sequence[RankPlan], units: int) -> Fitted:
    candidate = fitted.candidate
    job = replace(candidate.job, recompute=tuple(p.recompute for p in plans))
    # A recomputation runs the same kinds of call again: each rank's kernel scratch stays.
    ranks = tuple(
        replace(m, step_peak_bytes=p.peak_bytes - m.held_bytes - m.scratch_bytes)
        for m, p in zip(fitted.ranks, plans, strict=True)
    )
    counts = "/".join(str(len(p.recompute)) for p in plans)
    label = f"{candidate.label}, recomputing {counts} of {units} units per rank"
    seconds = max(p.recompute_seconds for p in plans)
    return Fitted(replace(candidate, job=job, label=label), ranks, seconds)


def fit_recomputing(
    stored: Sequence[Fitted],
    budget_bytes: int,
    least: Fitted,
    units_of: Callable[[Any, int], tuple[Unit, ...]],
) -> tuple[Fitted | None, Fitted]:
    """The fastest of ``stored`` (candidates with every rank's stored-activation peak) with each
    rank's recomputation planned for ``budget_bytes``, or None; and the least-memory option seen
    (``least`` or a candidate recomputing every unit)."""
    best: Fitted | None = None
    over = sorted((f for f in stored if f.peak_bytes > budget_bytes), key=lambda f: f.seconds)
    for fitted in over:
        if best is not None and fitted.seconds >= best.seconds:
            break
        job = fitted.candidate.job
        units = [units_of(job, rank) for rank in range(job.grid.size)]
        known: list[dict[frozenset[int], int]] = [{frozenset(): m.peak_bytes} for m in fitted.ranks]
        peaks = [_peaks(job, rank, known[rank]) for rank in range(job.grid.size)]
        everything = [frozenset(u.index for u in rank_units) for rank_units in units]
        lowest = [
            RankPlan(e, peak_of(e), sum(u.recompute_seconds for u in rank_units))
            for e, peak_of, rank_units in zip(everything, peaks, units, strict=True)
        ]
        total = max((len(e) for e in everything), default=0)
        floor = _planned(fitted, lowest, total)
        if floor.peak_bytes < least.peak_bytes:
            least = floor
        if floor.peak_bytes > budget_bytes:
            continue
        plans = [
            plan_rank(rank_units, peak_of, budget_bytes)
            for rank_units, peak_of in zip(units, peaks, strict=True)
        ]
        chosen = _planned(fitted, plans, total)
        if best is None or chosen.seconds < best.seconds:
            best = chosen
    return best, least


def rank_units(job: Any, rank: int, macs_per_second: float) -> tuple[Unit, ...]:
    """The units ``rank`` of ``job`` may recompute: the layers of a chain model's fused groups,
    or the local stretches of a graph model (its replicated tail's residual blocks)."""
    import torch

    from edgetrain.tiles.worker import DTYPES

    element_bytes = DTYPES[job.dtype].itemsize
    if job.cut is None:
        from edgetrain.tiles.rankplan import chain_units

        return chain_units(job.plan(), rank, job.batch, element_bytes, macs_per_second)
    from edgetrain.tiles.graph import analyse, place
    from edgetrain.tiles.graphunits import graph_units

    dtype = next(job.model.parameters()).dtype
    sample = torch.zeros(job.batch, job.channels, *job.image, dtype=dtype)
    graph, infos = analyse(job.model, sample)
    return graph_units(graph, infos, place(graph, infos, job.grid, job.cut), macs_per_second)
