"""A rank recomputes inside its fused groups or its tail when its budget asks: the least-time
plan, the step exact against one process (float64), every measured peak = its prediction and
within the budget; a budget no plan fits is refused naming the least."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetrain.errors import InvalidInput
from edgetrain.models import build
from edgetrain.tiles.budget import Candidate, fit_budget, predict_ranks
from edgetrain.tiles.check import max_relative_difference, reference
from edgetrain.tiles.grid import Grid, parse_groups
from edgetrain.tiles.launch import run_local
from edgetrain.tiles.rankplan import CELLS, Operation, Unit, cheapest_saving, stretches
from edgetrain.tiles.recompute_fit import fit_recomputing, rank_units
from edgetrain.tiles.worker import TileJob
from edgetrain.units import format_bytes

units_strategy = st.lists(
    st.tuples(st.integers(0, 5000), st.floats(0.0, 10.0, allow_nan=False)), min_size=1, max_size=7
)


@settings(max_examples=200, deadline=None)
@given(units_strategy, st.integers(-10, 40000))
def test_cheapest_saving_is_the_least_time_subset_saving_enough(pairs, need):
    units = [Unit(i, s, t) for i, (s, t) in enumerate(pairs)]
    chosen = cheapest_saving(units, need, cells=CELLS)
    total = sum(s for s, _ in pairs)
    cell = max(1, -(-total // CELLS))

    def saves(subset):  # the knapsack's rounded-down savings reach the rounded-up need
        return sum(units[i].saved_bytes // cell for i in subset) >= -(-need // cell)

    fitting = [
        sum(units[i].recompute_seconds for i in subset)
        for k in range(len(units) + 1)
        for subset in itertools.combinations(range(len(units)), k)
        if need <= 0 or saves(subset)
    ]
    if not fitting:
        assert chosen is None
        return
    assert chosen is not None
    assert need <= 0 or saves(chosen)
    assert sum(units[i].recompute_seconds for i in chosen) == pytest.approx(min(fitting))


def test_stretches_are_the_local_blocks_between_single_live_values():
    def op(name, reads, window=False, local=True):
        return Operation(name, tuple(reads), window, local)

    operations = [
        op("x", (), local=False),
        op("stem", ["x"], window=True),
        op("relu", ["stem"]),
        op("conv1", ["relu"], window=True),  # block: two live values inside it
        op("conv2", ["conv1"], window=True),
        op("add", ["conv2", "relu"]),
        op("halo", ["add"], window=True, local=False),
        op("bn", ["halo"]),
        op("out", ["bn"], local=False),
    ]
    found = stretches(operations)
    assert [(s.start, s.stop, s.source, s.result) for s in found] == [
        (1, 3, "x", "relu"),
        (3, 6, "relu", "add"),
    ]


def _planned(job: TileJob, fraction: float):
    """The job fitted to a budget ``fraction`` of the way from its least peak (every unit
    recomputed) to its peak storing everything; both peaks."""

    def units_of(j, rank):
        return rank_units(j, rank, 1e9)

    stored = max(m.peak_bytes for m in predict_ranks(job))
    everything = tuple(frozenset(u.index for u in units_of(job, r)) for r in range(job.grid.size))
    least = max(m.peak_bytes for m in predict_ranks(replace(job, recompute=everything)))
    assert least < stored
    budget = int(least + fraction * (stored - least))
    first = Candidate(job, 1.0, "asked")
    with pytest.raises(InvalidInput, match="give --memory"):  # storing everything: refused
        fit_budget(first, lambda: iter(()), budget, job.grid.size, format_bytes)
    recompute = functools.partial(fit_recomputing, units_of=units_of)
    fitted = fit_budget(first, lambda: iter(()), budget, job.grid.size, format_bytes, recompute)
    with pytest.raises(InvalidInput, match=f"with every rank's recomputation .* {least} or more"):
        fit_budget(first, lambda: iter(()), least - 1, job.grid.size, format_bytes, recompute)
    return fitted, budget


def _trains_exactly_within(fitted, budget: int) -> None:
    job = fitted.candidate.job
    assert any(job.recompute)
    results = run_local([job], timeout=300.0)[0]
    for memory, result in zip(fitted.ranks, results, strict=True):
        measured = memory.held_bytes + result.peak_bytes
        assert measured == memory.peak_bytes  # the prediction is the same step, counted
        assert measured <= budget
    assert max_relative_difference(job, results, reference(job)) < 1e-10


def test_yolov2_ranks_recompute_layers_of_their_groups_exactly_within_the_budget():
    torch.manual_seed(0)
    chain = build("yolov2-16")
    groups = parse_groups("0-3,4-7,8-15", len(chain))
    job = TileJob(chain, (67, 67), 2, Grid(1, 2), groups, steps=3, dtype="float64", collect=True)
    fitted, budget = _planned(job, 0.5)
    _trains_exactly_within(fitted, budget)


def test_resnet18_ranks_recompute_blocks_of_their_tail_exactly_within_the_budget():
    torch.manual_seed(0)
    model = build("resnet18")
    job = TileJob(model, (64, 64), 2, Grid(1, 2), (), steps=3, dtype="float64", cut=20)
    fitted, budget = _planned(replace(job, collect=True), 0.3)
    assert all(rank_units(job, 0, 1e9))  # the stem and the tail's residual blocks
    _trains_exactly_within(fitted, budget)
