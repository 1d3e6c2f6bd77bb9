"""Budgets with kernel scratch: a stage's scratch sits on its transient peaks, so the heap a plan
takes is the tensor peak of the same chain with the scratch folded into each stage's forward and
backward peaks; every strategy's plans hold their budget on the heap, the reported smallest
included; the dynamic program's answer equals brute force on the folded chain."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgetrain.core.chain import Chain, Stage
from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget
from edgetrain.planners import FRONTIER_STRATEGIES, plan
from edgetrain.planners.optimal import OptimalTable, store_all
from tests.conftest import every_kind_chain, random_chain
from tests.exhaustive import fastest_schedule

LOOPS = (False, True)
PROPERTY = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def with_scratch(chain: Chain, rng: random.Random, scale: int = 10) -> Chain:
    """``chain`` whose stages take random scratch (about half of them none)."""

    def some() -> int:
        return rng.randint(1, scale) if rng.random() < 0.5 else 0

    stages = tuple(
        dataclasses.replace(s, forward_scratch_bytes=some(), backward_scratch_bytes=some())
        for s in chain.stages
    )
    return dataclasses.replace(chain, stages=stages, autograd_peak_bytes=None)


def folded(chain: Chain) -> Chain:
    """``chain`` with each stage's scratch added to its transient peaks, and none left apart."""

    def fold(s):  # type: ignore[no-untyped-def]
        kept = s.backward_peak_kept_bytes
        return dataclasses.replace(
            s,
            forward_peak_bytes=s.forward_peak_bytes + s.forward_scratch_bytes,
            forward_grad_peak_bytes=s.forward_grad_peak_bytes + s.forward_scratch_bytes,
            backward_peak_bytes=s.backward_peak_bytes + s.backward_scratch_bytes,
            backward_peak_kept_bytes=None if kept is None else kept + s.backward_scratch_bytes,
            forward_scratch_bytes=0,
            backward_scratch_bytes=0,
        )

    return dataclasses.replace(chain, stages=tuple(fold(s) for s in chain.stages))


def tensors_only(chain: Chain) -> Chain:
    stages = tuple(
        dataclasses.replace(s, forward_scratch_bytes=0, backward_scratch_bytes=0)
        for s in chain.stages
    )
    return dataclasses.replace(chain, stages=stages)


def scratch_chains(max_length: int) -> st.SearchStrategy[Chain]:
    return st.builds(
        lambda seed, length: with_scratch(
            every_kind_chain(random.Random(seed), length), random.Random(seed + 1)
        ),
        st.integers(0, 2**31),
        st.integers(1, max_length),
    )


@pytest.mark.parametrize("grads_exist", LOOPS)
@PROPERTY
@given(chain=scratch_chains(7), data=st.data())
def test_the_heap_is_the_tensor_peak_with_the_scratch_on_the_transient_peaks(
    grads_exist, chain, data
):
    strategy = data.draw(st.sampled_from(FRONTIER_STRATEGIES))
    top = simulate(chain, store_all(chain), grads_exist=grads_exist).heap_peak_bytes
    budget = data.draw(st.integers(1, top))
    try:
        schedule = plan(chain, strategy, memory=budget, grads_exist=grads_exist)
    except InfeasibleBudget:
        schedule = store_all(chain)
    cost = simulate(chain, schedule, grads_exist=grads_exist)
    assert (
        cost.heap_peak_bytes
        == simulate(folded(chain), schedule, grads_exist=grads_exist).peak_bytes
    )
    # The tensors are the tensors: the scratch changes none of them, nor the time.
    alone = simulate(tensors_only(chain), schedule, grads_exist=grads_exist)
    assert (cost.peak_bytes, cost.seconds) == (alone.peak_bytes, alone.seconds)
    assert cost.heap_peak_bytes >= cost.peak_bytes


@pytest.mark.parametrize("grads_exist", LOOPS)
@pytest.mark.parametrize("strategy", FRONTIER_STRATEGIES)
@PROPERTY
@given(chain=scratch_chains(7), data=st.data())
def test_every_plan_holds_its_budget_on_the_heap_from_the_reported_smallest_up(
    strategy, grads_exist, chain, data
):
    with pytest.raises(InfeasibleBudget) as info:
        plan(chain, strategy, memory=1, grads_exist=grads_exist)
    smallest = info.value.smallest
    assert smallest is not None
    at = plan(chain, strategy, memory=smallest, grads_exist=grads_exist)
    assert simulate(chain, at, grads_exist=grads_exist).heap_peak_bytes <= smallest
    top = simulate(chain, store_all(chain), grads_exist=grads_exist).heap_peak_bytes
    for budget in sorted(data.draw(st.lists(st.integers(1, top + 8), min_size=1, max_size=5))):
        if budget < smallest:
            with pytest.raises(InfeasibleBudget):
                plan(chain, strategy, memory=budget, grads_exist=grads_exist)
            continue
        schedule = plan(chain, strategy, memory=budget, grads_exist=grads_exist)
        assert simulate(chain, schedule, grads_exist=grads_exist).heap_peak_bytes <= budget


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 5), st.integers(0, 140))
def test_the_dynamic_program_with_scratch_equals_brute_force_on_the_folded_chain(
    seed, length, budget
):
    rng = random.Random(seed)
    chain = with_scratch(random_chain(rng, length), rng)
    table = OptimalTable(chain, 1.0, 170, release=False)  # one-byte slots: no rounding
    best, _ = fastest_schedule(folded(chain), budget)
    assert table.time(budget) == pytest.approx(best, abs=1e-9) or (
        math.isinf(best) and math.isinf(table.time(budget))
    )
    if math.isfinite(best):
        cost = simulate(chain, table.schedule(budget))
        assert cost.seconds == pytest.approx(best)
        assert cost.heap_peak_bytes <= budget


def test_scratch_is_gone_when_its_operation_returns():
    """A backward that leaves more held (the parameter gradients it creates) than it peaks at
    while running: its scratch counts on the transient peak, not on what it leaves."""
    stage = Stage(
        name="s",
        output_bytes=10,
        saved_bytes=0,
        saves_input=False,
        saves_output=False,
        forward_peak_bytes=10,
        forward_grad_peak_bytes=10,
        backward_peak_bytes=1,
        weight_bytes=40,
        gradient_bytes=40,
        forward_seconds=1.0,
        backward_seconds=1.0,
        backward_scratch_bytes=5,
    )
    chain = Chain((stage,), input_bytes=4)
    cost = simulate(chain, store_all(chain))
    # The backward runs on the output and its gradient (20) with a peak of 1 and 5 of scratch,
    # then holds the 40 bytes of gradients it made: the heap's peak is the tensors' peak.
    assert cost.peak_bytes == simulate(tensors_only(chain), store_all(chain)).peak_bytes
    assert cost.heap_peak_bytes == max(cost.peak_bytes, 10 + 10 + 1 + 5)
    assert cost.heap_peak_bytes == simulate(folded(chain), store_all(chain)).peak_bytes
