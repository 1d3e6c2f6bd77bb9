"""The one budget search, for every strategy and both training loops: feasibility monotone in the
budget, the reported smallest budget plans (and one byte less does not, where the search is
exact), every plan within its budget, the least memory within a recompute factor, and the
dynamic program's answers equal to brute force on short chains (:mod:`tests.exhaustive`)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from edgetrain.core.chain import Chain, Stage, uniform_chain
from edgetrain.core.schedule import Op
from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget
from edgetrain.paper.linear_resnet import linear_resnet_chain
from edgetrain.planners import FRONTIER_STRATEGIES, plan
from edgetrain.planners.budget import frontier_of, optimal_candidates
from edgetrain.planners.optimal import DEFAULT_SLOTS, TableMaker, store_all
from edgetrain.planners.search import frontier, plan_for_device, tradeoff
from tests.conftest import chains, every_kind_chain, every_kind_chains, random_chain
from tests.exhaustive import fastest_schedule

LOOPS = (False, True)
PROPERTY = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def refused_smallest(chain: Chain, strategy: str, budget: float, grads_exist: bool) -> float:
    with pytest.raises(InfeasibleBudget) as info:
        plan(chain, strategy, memory=budget, grads_exist=grads_exist)
    assert info.value.smallest is not None
    return info.value.smallest


# -- memory budgets --------------------------------------------------------------------------------


@pytest.mark.parametrize("grads_exist", LOOPS)
@pytest.mark.parametrize("strategy", FRONTIER_STRATEGIES)
@PROPERTY
@given(chain=every_kind_chains(1, 7), data=st.data())
def test_every_budget_from_the_reported_smallest_up_plans_within_it_and_none_below(
    strategy, grads_exist, chain, data
):
    smallest = refused_smallest(chain, strategy, 1, grads_exist)
    assert smallest == int(smallest) and smallest > 0
    # A retry with the number the error gave plans, within it.
    at = simulate(
        chain,
        plan(chain, strategy, memory=smallest, grads_exist=grads_exist),
        grads_exist=grads_exist,
    )
    assert at.peak_bytes <= smallest
    # Every refused budget reports the same smallest; every budget from it up plans.
    top = simulate(chain, store_all(chain), grads_exist=grads_exist).peak_bytes
    budgets = data.draw(st.lists(st.integers(1, int(top) + 8), min_size=1, max_size=6))
    for budget in sorted(budgets):
        if budget < smallest:
            assert refused_smallest(chain, strategy, budget, grads_exist) == smallest
            continue
        schedule = plan(chain, strategy, memory=budget, grads_exist=grads_exist)
        assert simulate(chain, schedule, grads_exist=grads_exist).peak_bytes <= budget


@pytest.mark.parametrize("grads_exist", LOOPS)
@pytest.mark.parametrize("strategy", FRONTIER_STRATEGIES)
@PROPERTY
@given(chain=chains(1, 6))
def test_the_smallest_budget_is_minimal_where_the_search_is_exact(strategy, grads_exist, chain):
    found = frontier(chain, strategy, grads_exist=grads_exist)
    assume(found.exact)
    smallest = found.smallest_bytes
    assert refused_smallest(chain, strategy, 1, grads_exist) == smallest
    if smallest > 1:
        assert refused_smallest(chain, strategy, smallest - 1, grads_exist) == smallest


@pytest.mark.parametrize("grads_exist", LOOPS)
@pytest.mark.parametrize("strategy", FRONTIER_STRATEGIES)
def test_the_frontier_is_sorted_pareto_and_each_point_is_its_own_plans_cost(strategy, grads_exist):
    chain = every_kind_chain(random.Random(7), 9, scale=40)
    points = frontier(chain, strategy, grads_exist=grads_exist).points
    assert points
    for before, after in itertools.pairwise(points):
        assert before.peak_bytes < after.peak_bytes and before.seconds > after.seconds
    for point in points:
        cost = simulate(chain, point.schedule, grads_exist=grads_exist)
        assert (cost.peak_bytes, cost.seconds) == (point.peak_bytes, point.seconds)
        budget = plan(chain, strategy, memory=point.peak_bytes, grads_exist=grads_exist)
        assert simulate(chain, budget, grads_exist=grads_exist).seconds <= point.seconds + 1e-9


# -- brute force on short chains -------------------------------------------------------------------


def least_budget(
    chain: Chain, grads_exist: bool, seconds: float, release: bool, persistent: bool = True
) -> int:
    """The fewest bytes within which some schedule takes at most ``seconds`` (bisection over
    the exhaustive search of :func:`tests.exhaustive.fastest_schedule`'s class: rotor's with
    ``release=False`` and ``persistent``)."""
    low, high = 0, simulate(chain, store_all(chain), grads_exist=grads_exist).peak_bytes
    while low < high:
        middle = (low + high) // 2
        time, found = fastest_schedule(
            chain, middle, release=release, grads_exist=grads_exist, persistent=persistent
        )
        if found is not None and time <= seconds * (1 + 1e-9):
            high = middle
        else:
            low = middle + 1
    return low


def rotor_frontier(chain: Chain, grads_exist: bool):
    """The frontier of rotor's recursion alone (no *release* start): the class of schedules
    :func:`tests.exhaustive.fastest_schedule` searches by default (nested and persistent)."""
    maker = TableMaker(chain, grads_exist, release=False)
    return frontier_of(chain, "optimal", optimal_candidates([maker], DEFAULT_SLOTS), grads_exist)


@pytest.mark.parametrize("grads_exist", LOOPS)
@settings(max_examples=40, deadline=None)
@given(chain=chains(1, 5))
def test_the_dynamic_programs_smallest_budget_equals_brute_force(grads_exist, chain):
    """Like with like: the frontier of rotor's recursion (:func:`rotor_frontier`) against the
    exhaustive search over rotor's class (nested, persistent: every checkpoint held until its
    own stage's ``Fa``, no ``Fr``): the same least memory, and at it the same least time. The
    planner (rotor's recursion, the release start, storing everything) needs no more than
    rotor's least and no less than the least of every nested schedule with ``Fr`` whose
    checkpoints may be dropped early (a larger class, which can be faster: see
    :func:`test_a_checkpoint_dropped_before_its_backward_is_outside_the_recursion`)."""
    rotor = rotor_frontier(chain, grads_exist)
    assume(rotor.exact)
    least = least_budget(chain, grads_exist, math.inf, release=False)
    assert rotor.smallest_bytes == least
    best, _ = fastest_schedule(chain, least, grads_exist=grads_exist)
    assert rotor.points[0].seconds == pytest.approx(best, rel=1e-9)
    # The planner (rotor's recursion and the release start): between the two classes.
    smallest = frontier(chain, "optimal", grads_exist=grads_exist).smallest_bytes
    possible = least_budget(chain, grads_exist, math.inf, release=True, persistent=False)
    assert possible <= smallest <= least


@pytest.mark.parametrize("grads_exist", LOOPS)
@PROPERTY
@given(chain=chains(1, 5), rho=st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0, 3.0]))
def test_the_recompute_search_returns_the_least_memory_within_the_factor(grads_exist, chain, rho):
    """Like with like, as above: rotor's frontier's least memory within ``rho`` and its time
    there equal the exhaustive search's over rotor's class (nested, persistent, no ``Fr``);
    the planner's plan within ``rho`` holds no more than that and no less than the least of
    every nested schedule with ``Fr`` and checkpoints dropped early."""
    plain = chain.forward_seconds + chain.backward_seconds
    rotor = rotor_frontier(chain, grads_exist)
    assume(rotor.exact)
    least = least_budget(chain, grads_exist, rho * plain, release=False)
    point = rotor.least_within(rho)
    assert point is not None and point.peak_bytes == least
    # Ties go to the faster: the fastest schedule within that memory.
    best, _ = fastest_schedule(chain, least, grads_exist=grads_exist)
    assert point.seconds == pytest.approx(best, rel=1e-9)
    cost = simulate(
        chain,
        plan(chain, "optimal", max_recompute=rho, grads_exist=grads_exist),
        grads_exist=grads_exist,
    )
    assert cost.recompute_factor <= rho + 1e-9
    possible = least_budget(chain, grads_exist, rho * plain, release=True, persistent=False)
    assert possible <= cost.peak_bytes <= least


def test_a_checkpoint_dropped_before_its_backward_is_outside_the_recursion():
    """Four unit-time stages (outputs 1, 2, 1 and 3 bytes; stages 2 and 3 peak at 15 and 22
    bytes building their graphs). At the least memory, 24 bytes, rotor's recursion recomputes
    ``a[1]`` and ``a[2]`` after ``B3``: 13 s, the exhaustive search over its class agrees. A
    schedule outside it keeps the checkpoint ``a[1]`` across ``B3``, spends it on ``Fn1`` and
    lets ``Fa0``, which runs anyway, make it again: one forward less, 12 s in the same 24
    bytes. So the brute force the DP is compared with must be persistent."""

    def stage(name, out, saved, grad_peak, saves_input):
        return Stage(
            name=name,
            output_bytes=out,
            saved_bytes=saved,
            saves_input=saves_input,
            saves_output=False,
            forward_peak_bytes=out,
            forward_grad_peak_bytes=grad_peak,
            backward_peak_bytes=1,
            weight_bytes=0,
            gradient_bytes=0,
            forward_seconds=1.0,
            backward_seconds=1.0,
        )

    chain = Chain(
        (
            stage("s0", 1, 0, 1, False),
            stage("s1", 2, 1, 3, False),
            stage("s2", 1, 0, 15, True),
            stage("s3", 3, 0, 22, False),
        ),
        input_bytes=1,
    )
    rotor = rotor_frontier(chain, False)
    assert rotor.exact
    assert (rotor.smallest_bytes, rotor.points[0].seconds) == (24, 13.0)
    assert least_budget(chain, False, math.inf, release=False) == 24
    assert fastest_schedule(chain, 24)[0] == 13.0
    wider, schedule = fastest_schedule(chain, 24, persistent=False)
    assert wider == 12.0 and schedule is not None
    cost = simulate(chain, schedule)
    assert (cost.peak_bytes, cost.seconds) == (24, 12.0)
    assert [(Op(k), int(i)) for k, i in zip(schedule.kinds, schedule.indices, strict=True)][:6] == [
        (Op.FORWARD_CHECKPOINT, 0),
        (Op.FORWARD_CHECKPOINT, 1),
        (Op.FORWARD_NOSAVE, 2),
        (Op.FORWARD_ALL, 3),
        (Op.BACKWARD, 3),
        (Op.FORWARD_NOSAVE, 1),
    ]


@pytest.mark.parametrize("grads_exist", LOOPS)
@pytest.mark.parametrize("strategy", ("sequential", "revolve"))
@pytest.mark.parametrize("rho", [1.0, 1.2, 1.5, 2.0, 3.0])
def test_a_family_recompute_search_keeps_the_least_memory_within_the_factor(
    strategy, grads_exist, rho
):
    chain = every_kind_chain(random.Random(11), 12, scale=30)
    costs = [c for c, _ in _family(chain, strategy, grads_exist)]
    within = [c for c in costs if c.recompute_factor <= rho + 1e-9]
    if not within:
        with pytest.raises(InfeasibleBudget) as info:
            plan(chain, strategy, max_recompute=rho, grads_exist=grads_exist)
        plan(chain, strategy, max_recompute=info.value.smallest, grads_exist=grads_exist)
        return
    least = min(c.peak_bytes for c in within)
    fastest = min(c.seconds for c in within if c.peak_bytes == least)
    cost = simulate(
        chain,
        plan(chain, strategy, max_recompute=rho, grads_exist=grads_exist),
        grads_exist=grads_exist,
    )
    assert (cost.peak_bytes, cost.seconds) == (least, pytest.approx(fastest))


def _family(chain: Chain, strategy: str, grads_exist: bool):
    from edgetrain.planners.revolve import revolve
    from edgetrain.planners.sequential import sequential

    make = sequential if strategy == "sequential" else revolve
    for knob in range(1, chain.length + 1):
        schedule = make(chain, knob)
        yield simulate(chain, schedule, grads_exist=grads_exist), schedule


# -- long chains and whole devices -----------------------------------------------------------------


def test_a_long_chains_recompute_factor_gives_less_than_storing_everything():
    """LinearResNet-152's chain (ResNet-152's weights and activations at batch 8, 500², spread
    over 152 equal layers): within ρ 1.6 a plan holds a fraction of plain autograd's memory, and
    the trade-off has a point for every distinct plan, not one."""
    chain = linear_resnet_chain(152, 241_662_976, 45_958_791_168)
    everything = simulate(chain, store_all(chain)).peak_bytes
    cost = simulate(chain, plan(chain, "optimal", max_recompute=1.6))
    assert cost.recompute_factor <= 1.6 + 1e-9
    assert cost.peak_bytes < 0.2 * everything
    assert len(tradeoff(chain, "optimal")) > 20


@pytest.mark.parametrize("strategy", FRONTIER_STRATEGIES)
def test_a_device_budget_below_the_fixed_part_reports_a_smallest_that_plans(strategy):
    chain = every_kind_chain(random.Random(3), 10, scale=50)
    fixed = 5_000
    for grads_exist in LOOPS:
        with pytest.raises(InfeasibleBudget) as info:
            plan_for_device(
                chain, strategy, device_bytes=fixed // 2, fixed_bytes=fixed, grads_exist=grads_exist
            )
        smallest = info.value.smallest
        assert smallest is not None and smallest > fixed
        schedule = plan_for_device(
            chain, strategy, device_bytes=smallest, fixed_bytes=fixed, grads_exist=grads_exist
        )
        assert fixed + simulate(chain, schedule, grads_exist=grads_exist).peak_bytes <= smallest
        # Between the fixed part and the smallest: refused with the same number.
        with pytest.raises(InfeasibleBudget) as again:
            plan_for_device(
                chain,
                strategy,
                device_bytes=smallest - 1,
                fixed_bytes=fixed,
                grads_exist=grads_exist,
            )
        assert again.value.smallest == smallest


def test_a_uniform_chain_frontier_runs_from_the_least_memory_to_storing_everything():
    chain = uniform_chain(12, activation_bytes=8)
    points = frontier(chain).points
    assert points[-1].recompute_factor == 1.0
    assert points[-1].peak_bytes == simulate(chain, store_all(chain)).peak_bytes
    assert points[0].peak_bytes == least_budget(chain, False, math.inf, release=False)


def test_a_random_chains_frontier_is_kept_so_a_retry_plans_once():
    chain = random_chain(random.Random(5), 10)
    assert frontier(chain) is frontier(chain)
