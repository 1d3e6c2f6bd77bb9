"""A rank recomputes inside its fused groups or its tail when its budget asks: the least-time
plan, the step exact against one process (float64), every measured peak = its prediction and
within the budget; a budget no plan fits is refused naming the least."""

from __future__ import annotations

import functools
import itertools
import json
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
from edgetrain.tiles.rankplan import (
    CELLS,
    Operation,
    Unit,
    cheapest_saving,
    plan_rank,
    stretches,
)
from edgetrain.tiles.recompute_fit import fit_recomputing, rank_units
from edgetrain.tiles.worker import TileJob
from edgetrain.units import format_bytes
from tests.tiles.heap_beyond import HEAP_BEYOND_BYTES

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


@settings(max_examples=200, deadline=None)
@given(units_strategy, st.integers(0, 3000), st.integers(0, 40000))
def test_plan_rank_fits_whenever_recomputing_everything_fits(pairs, base, budget):
    units = [Unit(i, s, t) for i, (s, t) in enumerate(pairs)]
    calls = []

    def peak_of(recompute):  # a rank whose peak is exactly what it stores
        calls.append(recompute)
        return base + sum(u.saved_bytes for u in units if u.index not in recompute)

    plan = plan_rank(units, peak_of, budget)
    assert plan.peak_bytes == peak_of(plan.recompute)
    assert (plan.peak_bytes <= budget) == (base <= budget)
    if base + sum(s for s, _ in pairs) <= budget:
        assert plan.recompute == frozenset()
    assert len(set(calls)) <= len(units) + 2  # each plan tried is measured once


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


def _units_of(job, rank):
    return rank_units(job, rank, 1e9)


def _planned(job: TileJob, fraction: float, refusal: bool):
    """The job fitted to a budget ``fraction`` of the way from its least peak (every unit
    recomputed) to its peak storing everything (which refuses it); with ``refusal``, the
    budget one byte below the least is refused naming the least."""
    stored = max(m.peak_bytes for m in predict_ranks(job))
    everything = tuple(frozenset(u.index for u in _units_of(job, r)) for r in range(job.grid.size))
    least = max(m.peak_bytes for m in predict_ranks(replace(job, recompute=everything)))
    assert least < stored
    budget = int(least + fraction * (stored - least))
    first = Candidate(job, 1.0, "asked")
    recompute = functools.partial(fit_recomputing, units_of=_units_of)
    if refusal:
        with pytest.raises(InvalidInput, match=f"with every rank's recomputation .* {least} or"):
            fit_budget(first, lambda: iter(()), least - 1, job.grid.size, format_bytes, recompute)
    fitted = fit_budget(first, lambda: iter(()), budget, job.grid.size, format_bytes, recompute)
    assert stored > budget >= fitted.peak_bytes  # storing everything does not fit; this does
    return fitted, budget


def _trains_exactly_within(fitted, budget: int) -> None:
    job = fitted.candidate.job
    assert any(job.recompute)
    results = run_local([job], timeout=300.0)[0]
    for memory, result in zip(fitted.ranks, results, strict=True):
        measured = memory.held_bytes + result.peak_bytes
        assert measured == memory.tensor_peak_bytes  # the prediction is the same step, counted
        assert memory.peak_bytes == measured + memory.scratch_bytes <= budget
        if result.heap_peak_bytes is not None:  # the kernels' scratch too, sampled
            heap = memory.held_bytes + result.heap_peak_bytes
            assert heap <= memory.peak_bytes + HEAP_BEYOND_BYTES
    assert max_relative_difference(job, results, reference(job)) < 1e-10


@pytest.mark.timeout(1200)  # a dozen predicted steps and a run on a loaded 2-core machine
def test_yolov2_ranks_recompute_layers_of_their_groups_exactly_within_the_budget():
    torch.manual_seed(0)
    chain = build("yolov2-16")
    groups = parse_groups("0-3,4-7,8-15", len(chain))
    job = TileJob(chain, (67, 67), 2, Grid(1, 2), groups, steps=3, dtype="float64", collect=True)
    fitted, budget = _planned(job, 0.5, refusal=True)
    _trains_exactly_within(fitted, budget)


@pytest.mark.timeout(1200)
def test_resnet18_ranks_recompute_blocks_of_their_tail_exactly_within_the_budget():
    torch.manual_seed(0)
    model = build("resnet18")
    job = TileJob(model, (64, 64), 2, Grid(1, 2), (), steps=3, dtype="float64", cut=20)
    fitted, budget = _planned(replace(job, collect=True), 0.3, refusal=False)
    _trains_exactly_within(fitted, budget)


@pytest.mark.timeout(1200)
def test_tiles_memory_below_storing_everything_trains_with_recomputation():
    from click.testing import CliRunner

    from edgetrain.cli.main import cli

    done = CliRunner().invoke(
        cli,
        ["tiles", "--grid", "1x2", "--image", "96", "--steps", "2", "--memory", "31MB", "--json"],
    )
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    assert doc["recoveries"] == [] and len(doc["ranks"]) == 2  # both boards ran every step
    assert all(doc["memory"]["recompute"])  # every rank recomputes some of its layers
    for rank in doc["ranks"]:
        assert rank["board_peak_bytes"] == rank["predicted_board_peak_bytes"]
        assert rank["predicted_board_heap_bytes"] <= 31_000_000
        # The heap beyond tensors and kernel scratch is not predicted (docs/tiles.md, Limits).
        assert (rank["board_heap_peak_bytes"] or 0) <= 31_000_000 + HEAP_BEYOND_BYTES
