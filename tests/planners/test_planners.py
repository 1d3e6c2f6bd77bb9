"""Planners: sequential is PyTorch's, revolve meets the binomial optimum, optimal = brute force."""

import dataclasses
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgetrain.core.chain import uniform_chain
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.models import model_chain
from edgetrain.planners import dp_kernels, plan
from edgetrain.planners.blocks import block_plan
from edgetrain.planners.optimal import (
    OptimalTable,
    TableMaker,
    minimum_memory,
    optimal,
    store_all,
)
from edgetrain.planners.revolve import (
    beta,
    optimal_forward_steps,
    repetitions,
    revolve,
    revolve_steps,
)
from edgetrain.planners.search import tradeoff
from edgetrain.planners.sequential import segment_bounds, sequential
from tests.conftest import chains, every_kind_chains, random_chain
from tests.exhaustive import fastest_schedule


def binomial_optimum(steps: int, slots: int) -> int:
    """p(l, s) = r·l − C(s + r, s + 1), r = min{r : C(s + r, s) >= l}, written independently."""
    r = 0
    while math.comb(slots + r, slots) < steps:
        r += 1
    return r * steps - math.comb(slots + r, slots + 1)


# -- sequential ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("length", "segments"), [(10, 1), (10, 3), (10, 10), (7, 2), (34, 6)])
def test_sequential_cuts_segments_like_checkpoint_sequential(length, segments):
    # torch: segment_size = L // s; the first s-1 segments are checkpointed, the last runs normally.
    size = length // segments
    bounds = segment_bounds(length, segments)
    assert bounds == [(i * size, i * size + size - 1) for i in range(segments - 1)]
    schedule = sequential(uniform_chain(length), segments)
    first_forward = schedule.kinds[: schedule.forward_phase_end]
    assert int((first_forward == Op.FORWARD_CHECKPOINT).sum()) == segments - 1
    tail = length - size * (segments - 1)
    assert int((first_forward == Op.FORWARD_ALL).sum()) == tail


@pytest.mark.parametrize("length", [9, 16, 50, 100])
def test_sequential_memory_is_the_papers_formula_and_never_below_2_sqrt_l(length):
    # §V: s - 1 checkpoints plus the last segment's l - floor(l/s)(s-1) activations.
    best = math.inf
    for segments in range(2, length + 1):
        cost = simulate(uniform_chain(length), sequential(uniform_chain(length), segments))
        formula = segments - 1 + (length - (length // segments) * (segments - 1))
        # Held at the peak (the last segment's first backward): the formula's activations, the
        # gradient of the output and the input gradient being made, one unit each.
        assert cost.peak_bytes == formula + 2
        best = min(best, formula)
    assert best >= 2 * math.sqrt(length) - 1


def test_sequential_rejects_impossible_segment_counts():
    with pytest.raises(InvalidInput, match="between 1 and"):
        sequential(uniform_chain(4), 5)


# -- revolve -------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("steps", [1, 2, 3, 7, 10, 20, 57, 100, 256])
def test_revolve_forward_steps_equal_the_binomial_optimum(steps, slots):
    schedule = revolve_steps(steps, slots)
    assert schedule.forward_steps == binomial_optimum(steps, min(slots, steps))
    assert schedule.forward_steps == optimal_forward_steps(steps, min(slots, steps))
    cost = simulate(uniform_chain(steps), schedule)  # valid, and within its slots
    assert cost.max_checkpoints <= max(slots, 1)


@pytest.mark.parametrize(
    ("steps", "slots", "numforw"),
    [(10, 2, 20), (10, 3, 15), (20, 4, 39), (100, 5, 316), (7, 7, 6), (1000, 10, 3636)],
)
def test_revolve_matches_pyrevolve_counts(steps, slots, numforw):
    # Values printed by pyrevolve's CRevolve (sum of ADVANCE lengths) for these arguments.
    assert revolve_steps(steps, slots).forward_steps == numforw


def test_revolve_plans_a_hundred_thousand_steps():
    schedule = revolve_steps(100_000, 10)
    assert schedule.forward_steps == binomial_optimum(100_000, 10) == 832_040
    assert schedule.count(Op.BACKWARD) == 100_000


def test_revolve_refuses_a_schedule_too_long_to_build():
    with pytest.raises(InvalidInput, match="give more slots"):
        revolve_steps(100_000, 1)


# -- optimal -------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(chains(max_length=5), st.integers(0, 120))
def test_optimal_equals_brute_force_on_small_random_chains(chain, budget):
    table = OptimalTable(chain, 1.0, 150, release=False)  # one-byte slots: no rounding
    best, reference = fastest_schedule(chain, budget)
    assert table.time(budget) == pytest.approx(best, abs=1e-9) or (
        math.isinf(best) and math.isinf(table.time(budget))
    )
    if math.isfinite(best):
        schedule = table.schedule(budget)
        cost = simulate(chain, schedule)
        assert cost.seconds == pytest.approx(best)
        assert cost.peak_bytes <= budget
        assert reference is not None and simulate(chain, reference).peak_bytes <= budget


def test_optimal_equals_brute_force_when_gradients_are_shared():
    """Stages whose input gradient is smaller than their input (an addition hands one gradient
    to both of its inputs): the table still equals the exhaustive search and the simulator."""
    rng = random.Random(23)
    for _ in range(12):
        chain = random_chain(rng, rng.randint(2, 5))
        stages = tuple(
            dataclasses.replace(
                s, input_gradient_bytes=rng.randint(0, chain.activation_bytes(k)) or None
            )
            for k, s in enumerate(chain.stages)
        )
        chain = dataclasses.replace(chain, stages=stages)
        table = OptimalTable(chain, 1.0, 150, release=False)
        for budget in range(5, 150, 9):
            best, _ = fastest_schedule(chain, budget)
            assert table.time(budget) == pytest.approx(best) or math.isinf(best)
            if math.isfinite(best):
                cost = simulate(chain, table.schedule(budget))
                assert cost.seconds == pytest.approx(best) and cost.peak_bytes <= budget


def test_optimal_charges_a_graph_only_the_input_tensors_it_saves():
    """Activations of two tensors (a trunk and a skip) of which a stage's graph saves one (a
    BatchNorm saves the trunk it normalises, not the skip added after it). The exhaustive
    search counts a graph that saves its input with the whole input, so every plan it finds is
    valid; the table, charging only the tensor saved, is never slower than it, strictly faster
    at some budgets, and every plan it gives fits its budget in the simulator."""
    rng = random.Random(31)
    faster = 0
    for _ in range(12):
        base = random_chain(rng, rng.randint(2, 5))
        stages = []
        for k, stage in enumerate(base.stages):
            leaves = (rng.randint(1, 6), rng.randint(1, 6)) if k + 1 < base.length else ()
            saved = (rng.randint(0, 1),) if k > 0 else None
            stages.append(
                dataclasses.replace(
                    stage,
                    output_bytes=sum(leaves) or stage.output_bytes,
                    leaf_bytes=leaves,
                    saves_input=stage.saves_input if saved is None else True,
                    saved_inputs=saved,
                )
            )
        chain = dataclasses.replace(base, stages=tuple(stages))
        table = OptimalTable(chain, 1.0, 150, release=False)
        for budget in range(5, 150, 7):
            whole, _ = fastest_schedule(chain, budget)
            assert table.time(budget) <= whole + 1e-9
            faster += table.time(budget) < whole - 1e-9
            if math.isfinite(table.time(budget)):
                cost = simulate(chain, table.schedule(budget))
                assert cost.seconds == pytest.approx(table.time(budget))
                assert cost.peak_bytes <= budget
    assert faster > 0


def test_optimal_equals_brute_force_on_six_stage_chains():
    rng = random.Random(7)
    for _ in range(4):
        chain = random_chain(rng, 6)
        table = OptimalTable(chain, 1.0, 140, release=False)
        for budget in range(10, 140, 13):
            best, _ = fastest_schedule(chain, budget)
            assert table.time(budget) == pytest.approx(best) or math.isinf(best)


@settings(max_examples=40, deadline=None)
@given(chains(min_length=2, max_length=5), st.integers(0, 120))
def test_releasing_an_input_is_never_slower_than_rotor_nor_faster_than_possible(chain, budget):
    """With the *release* start (``Fc s, Fr s+1 .. Fa s, B s+1, B s``) the table is at least as
    fast as rotor's optimum (the exhaustive search without ``Fr``) and never faster than the
    exhaustive search with ``Fr``; its plan runs in the simulator at the table's time, within
    the budget."""
    table = OptimalTable(chain, 1.0, 150)
    rotor, _ = fastest_schedule(chain, budget)
    bound, _ = fastest_schedule(chain, budget, release=True, persistent=False)
    assert table.time(budget) <= rotor + 1e-9
    assert table.time(budget) >= bound - 1e-9
    if math.isfinite(table.time(budget)):
        cost = simulate(chain, table.schedule(budget))
        assert cost.seconds == pytest.approx(table.time(budget))
        assert cost.peak_bytes <= budget


def test_releasing_an_input_beats_rotor_where_the_stage_before_is_cheap():
    """A cheap stage (GELU) between two expensive ones that save their inputs (linear layers):
    rebuilding the second's input by running the cheap one again saves memory for little
    time, which rotor can only buy by running the expensive one again. Exhaustive search
    agrees with the table on every budget."""
    base = uniform_chain(4, activation_bytes=8, weight_bytes=1)  # each stage saves its input
    times = [(10.0, 20.0), (0.5, 1.0), (10.0, 20.0), (0.5, 1.0)]
    stages = tuple(
        dataclasses.replace(stage, forward_seconds=f, backward_seconds=b)
        for stage, (f, b) in zip(base.stages, times, strict=True)
    )
    chain = dataclasses.replace(base, stages=stages)
    with_release = OptimalTable(chain, 1.0, 120)
    rotor = OptimalTable(chain, 1.0, 120, release=False)
    faster = 0
    for budget in range(0, 120):
        bound, _ = fastest_schedule(chain, budget, release=True, persistent=False)
        assert with_release.time(budget) >= bound - 1e-9
        assert with_release.time(budget) <= rotor.time(budget) + 1e-9
        faster += with_release.time(budget) < rotor.time(budget) - 1e-9
    assert faster > 0


@settings(max_examples=40, deadline=None)
@given(chains(min_length=2, max_length=30), st.floats(0.05, 1.0))
def test_optimal_plan_fits_its_budget_after_rounding(chain, fraction):
    plain = simulate(chain, store_all(chain)).peak_bytes
    budget = max(1.0, fraction * plain)
    try:
        schedule = optimal(chain, budget, slots=50)
    except InfeasibleBudget as exc:
        assert exc.smallest is not None and exc.smallest > budget * 0.999
        schedule = optimal(chain, exc.smallest, slots=50)  # the reported smallest works
        budget = exc.smallest
    assert simulate(chain, schedule).peak_bytes <= budget


def test_optimal_is_never_worse_than_sequential_or_revolve():
    chain = random_chain(random.Random(11), 20, scale=50)
    for schedule in [
        *(sequential(chain, s) for s in range(1, 21)),
        *(revolve(chain, s) for s in range(1, 21)),
    ]:
        cost = simulate(chain, schedule)
        best = simulate(chain, plan(chain, "optimal", memory=cost.peak_bytes))
        assert best.seconds <= cost.seconds * (1 + 1e-9)


# -- budget search -------------------------------------------------------------------------------


def test_search_both_ways_is_consistent():
    chain = random_chain(random.Random(5), 16, scale=40)
    for rho in (1.0, 1.2, 1.5, 2.0):
        schedule = plan(chain, "optimal", max_recompute=rho)
        cost = simulate(chain, schedule)
        assert cost.recompute_factor <= rho + 1e-9
        again = simulate(chain, plan(chain, "optimal", memory=cost.peak_bytes))
        assert again.recompute_factor <= cost.recompute_factor + 1e-9


def test_recompute_factor_one_stores_everything():
    chain = random_chain(random.Random(2), 10)
    assert simulate(chain, plan(chain, "optimal", max_recompute=1.0)).recompute_factor == 1.0


def test_infeasible_budget_reports_the_smallest_that_works():
    chain = random_chain(random.Random(9), 12, scale=30)
    smallest = minimum_memory(chain)
    with pytest.raises(InfeasibleBudget, match="smallest that works") as info:
        plan(chain, "optimal", memory=smallest * 0.5)
    assert info.value.smallest == pytest.approx(smallest)
    simulate(chain, plan(chain, "optimal", memory=smallest))  # and it does work
    with pytest.raises(InfeasibleBudget, match="needs at least") as info:
        plan(chain, "sequential", memory=1)
    segment_counts = range(1, chain.length + 1)
    least = min(simulate(chain, sequential(chain, s)).peak_bytes for s in segment_counts)
    assert info.value.smallest == least


@pytest.mark.parametrize("rho", [0.5, 0.999, float("nan")])
def test_recompute_factor_below_one_is_refused(rho):
    with pytest.raises(InvalidInput, match=">= 1"):
        plan(uniform_chain(4), "optimal", max_recompute=rho)


def test_revolve_cannot_reach_small_factors_and_says_its_smallest():
    with pytest.raises(InfeasibleBudget, match="smallest it reaches"):
        plan(uniform_chain(30), "revolve", max_recompute=1.2)


def test_tradeoff_curve_is_a_pareto_front():
    chain = uniform_chain(40, activation_bytes=100)
    for strategy in ("optimal", "revolve", "sequential"):
        points = tradeoff(chain, strategy)
        rhos = [r for r, _ in points]
        peaks = [p for _, p in points]
        assert rhos == sorted(rhos) and peaks == sorted(peaks, reverse=True)
    optimal_points = dict(tradeoff(chain, "optimal"))
    assert min(optimal_points) == 1.0
    # At every factor revolve reaches, the optimal plan needs no more memory.
    for rho, peak in tradeoff(chain, "revolve"):
        best = min(p for r, p in optimal_points.items() if r <= rho + 1e-9)
        assert best <= peak


def test_table_times_decrease_with_memory():
    chain = random_chain(random.Random(4), 10, scale=20)
    times = OptimalTable(chain, 1.0, 300).times()
    finite = times[np.isfinite(times)]
    assert finite.size > 0 and np.all(np.diff(finite) <= 1e-12)


def test_the_kernel_compiles_uncached_where_no_cache_directory_is_writable(monkeypatch):
    # numba finds no place for its cache (a read-only package, no writable home): it refuses
    # cache=True at import; the kernel is compiled in the process instead.
    from numba.core.caching import CacheImpl

    monkeypatch.setattr(CacheImpl, "_locator_classes", [])

    def twice(x: int) -> int:
        return 2 * x

    assert dp_kernels.compiled(twice)(21) == 42


def test_long_chains_get_a_table_that_fits_in_memory(monkeypatch):
    import edgetrain.planners.dp_table as module

    # A 40-stage chain with a 1 MiB table limit stands in for a 700-stage chain with 1 GiB.
    monkeypatch.setattr(module, "TABLE_LIMIT_BYTES", 2**20)
    chain = random_chain(random.Random(8), 40, scale=30)
    assert module.max_slots(40) < 500
    for rho in (1.2, 2.0):
        assert simulate(chain, plan(chain, "optimal", max_recompute=rho)).recompute_factor <= rho
    budget = simulate(chain, plan(chain, "optimal", max_recompute=2.0)).peak_bytes
    assert simulate(chain, plan(chain, "optimal", memory=budget)).peak_bytes <= budget
    with pytest.raises(InvalidInput, match="at most"):
        OptimalTable(chain, 1.0, 500)


def _recompute_head(length: int, k: int) -> Schedule:
    """Checkpoint the input, run stages 0..k-1 without saving, store the rest, and recompute
    the head after the tail's backward: one of the plans the DP chooses among."""
    ops = [(Op.FORWARD_CHECKPOINT, 0)] + [(Op.FORWARD_NOSAVE, i) for i in range(1, k)]
    ops += [(Op.FORWARD_ALL, i) for i in range(k, length)]
    ops += [(Op.BACKWARD, i) for i in reversed(range(k, length))]
    ops += [(Op.FORWARD_ALL, i) for i in range(k)] + [(Op.BACKWARD, i) for i in reversed(range(k))]
    return Schedule.from_ops(length, ops)


@pytest.mark.parametrize("k", [16, 32])
def test_optimal_beats_a_recomputed_head_on_a_transformer_with_carried_skips(k):
    # ViT-Tiny cut inside its residual blocks: most stages carry the skip tensor unchanged,
    # which the DP's table counts at every stage. The planner must still find a plan at least
    # as fast as this simple one within its simulated peak (it returned ρ 1.13 for ρ 1.04).
    chain = model_chain("vit-tiny", 8, 128)
    assert sum(1 for stage in chain.stages if stage.carried) > chain.length // 2
    hand = simulate(chain, _recompute_head(chain.length, k))
    found = simulate(chain, optimal(chain, hand.peak_bytes))
    assert found.peak_bytes <= hand.peak_bytes
    assert found.seconds <= hand.seconds * (1 + 1e-9)


def test_repetitions_is_the_least_r_whose_beta_reaches_the_steps():
    """Searched by bisection (step by step, one slot and 10^20 steps ran for hours)."""
    rng = random.Random(5)
    for _ in range(2000):
        steps, slots, start = rng.randint(1, 3000), rng.randint(1, 10), rng.randint(0, 15)
        reps = repetitions(steps, slots, start)
        assert reps >= start and beta(slots, reps) >= steps
        assert reps == start or beta(slots, reps - 1) < steps
    assert repetitions(10**20, 1) == 10**20 - 1


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    chain=every_kind_chains(2, 12),
    slots=st.integers(8, 120),
    grads_exist=st.booleans(),
    nearest=st.booleans(),
)
def test_skipping_the_slots_no_checkpoint_can_win_leaves_the_table_as_it_is(
    monkeypatch, chain, slots, grads_exist, nearest
):
    import edgetrain.planners.dp_table as module

    peak = simulate(chain, store_all(chain), grads_exist=grads_exist).peak_bytes
    slot_bytes = max(1.0, 1.5 * peak / slots)

    def filled() -> np.ndarray:
        table = OptimalTable(chain, slot_bytes, slots, grads_exist=grads_exist, nearest=nearest)
        start, end = np.triu_indices(table.length)  # the sub-chains s..t, t >= s
        return table._time[:, start, end].copy()

    skipping = filled()
    with monkeypatch.context() as patch:
        patch.setattr(module, "_least_times", lambda costs: None)  # every slot computed
        every = filled()
    assert np.array_equal(skipping, every)


@settings(max_examples=30, deadline=None)
@given(
    chain=every_kind_chains(2, 10),
    slots=st.integers(8, 80),
    grads_exist=st.booleans(),
    blocks=st.booleans(),
)
def test_a_rows_choices_come_with_the_times_the_fill_stored(chain, slots, grads_exist, blocks):
    # A plan is read one sub-chain at a time, its choices worked out again from the table: the
    # least times that pass finds (every slot, every option, no saturation skipped) are the
    # ones the fill stored, and each choice is a start that exists.
    maker = block_plan(chain, grads_exist=grads_exist).maker() if blocks else None
    maker = maker or TableMaker(chain, grads_exist)
    peak = simulate(chain, store_all(chain), grads_exist=grads_exist).peak_bytes
    table = maker.table(max(1.0, 1.2 * peak / slots), slots)
    size = slots + 1
    options = table._costs[1].shape[0]
    for span in range(table.length):
        for s in range(table.length - span):
            for pin in (0, 1):
                best, choice = np.empty(size), np.empty(size, dtype=np.int32)
                acc, pick = np.empty(size), np.empty(size, dtype=np.int64)
                args = (table._costs, table._table, pin, s, s + span, True)
                dp_kernels._row(*args, best, choice, acc, pick)
                assert np.array_equal(best, table._time[pin, s, s + span])
                assert np.all((choice >= -1 - options) & (choice <= s + span))


@given(every_kind_chains(max_length=6), st.integers(1, 12), st.booleans())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_where_rounding_does_not_matter_the_nearest_table_is_the_rounded_up_one(
    chain, slot_bytes, grads_exist
):
    maker = TableMaker(chain, grads_exist)
    up = maker.table(slot_bytes, 60)
    near = maker.table(slot_bytes, 60, nearest=True)
    if not maker.rounding_matters(slot_bytes):
        assert np.array_equal(up.times(), near.times())
    # A slot of one byte rounds nothing.
    assert not maker.rounding_matters(1)
