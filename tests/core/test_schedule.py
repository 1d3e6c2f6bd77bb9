"""The simulator: validity checks, memory accounting on hand-counted cases, and the file format."""

import itertools
import json
import random

import pytest
from hypothesis import given, settings

from edgetrain.core.chain import Chain, Stage, uniform_chain
from edgetrain.core.graph_merge import GraphRun, graph_runs, merged_schedule
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import memory_trace, simulate
from edgetrain.errors import CorruptFile, InfeasibleBudget, InvalidSchedule
from edgetrain.planners import FRONTIER_STRATEGIES, plan
from edgetrain.planners.optimal import store_all
from edgetrain.planners.sequential import sequential
from tests.conftest import chains, random_chain

F, C, A, B, D = (Op.FORWARD_NOSAVE, Op.FORWARD_CHECKPOINT, Op.FORWARD_ALL, Op.BACKWARD, Op.DISCARD)


def ops(n, *pairs):
    return Schedule.from_ops(n, list(pairs))


def test_store_all_on_a_uniform_chain_holds_every_activation_then_gradients():
    # 3 stages of 10 bytes that keep their input: after the forward the graphs hold a1..a3 (30);
    # the loss adds the output gradient (10); each backward peak adds one input gradient (10).
    cost = simulate(uniform_chain(3, activation_bytes=10), store_all(uniform_chain(3)))
    assert cost.peak_bytes == 30 + 10 + 10
    assert cost.recompute_factor == 1.0
    assert cost.forward_steps == 0


def test_recomputation_costs_time_and_saves_memory():
    chain = uniform_chain(4, activation_bytes=10)
    checkpointed = ops(
        4,
        (C, 0),
        (F, 1),
        (F, 2),
        (A, 3),
        (B, 3),
        (C, 0),
        (F, 1),
        (A, 2),
        (D, 3),
        (B, 2),
        (A, 0),
        (A, 1),
        (D, 2),
        (B, 1),
        (B, 0),
    )
    plain = simulate(chain, store_all(chain))
    cost = simulate(chain, checkpointed)
    assert cost.seconds == plain.seconds + 5  # Fc0 Fn1 Fn2, then Fc0 Fn1 again: 1 s each
    assert cost.forward_steps == 5
    assert cost.peak_bytes < plain.peak_bytes


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (ops(2, (A, 0), (B, 0)), "out of order"),
        (ops(2, (A, 1), (A, 0)), "needs a\\[1\\]"),
        (ops(2, (A, 0), (A, 0)), "already in memory"),
        (ops(2, (A, 0), (A, 1), (B, 1)), "ends before the backward of stage 0"),
        (ops(2, (C, 0), (A, 1), (B, 1), (B, 0)), "needs the graph of stage 0"),
        (ops(2, (A, 0), (D, 1), (A, 1), (B, 1), (B, 0)), "needs a\\[1\\], which is not held"),
        (ops(2, (A, 0), (A, 1), (D, 1), (B, 1), (B, 0)), "discards an activation that is not"),
        (ops(2, (C, 0), (A, 1), (B, 1), (C, 0), (A, 1)), "already done"),
        (ops(2, (C, 0), (C, 0)), "already in memory"),
        (ops(2, (A, 5)), "outside"),
        (ops(3, (A, 0), (A, 1), (B, 1)), "chain of 3 stages"),
    ],
)
def test_simulator_rejects_invalid_schedules_naming_the_operation(schedule, message):
    with pytest.raises(InvalidSchedule, match=message):
        simulate(uniform_chain(2), schedule)


def test_shared_storage_is_counted_once():
    # A stage that keeps its input: Fa1 drops our reference to a1, which stays held (once) by the
    # graph; a stage that keeps its output holds it once though our reference exists too.
    keeps_input = Stage("s", 10, 0, True, 10, 10, 10, 0, 0, 1.0, 1.0)
    chain = Chain((keeps_input, keeps_input), input_bytes=10)
    trace = memory_trace(chain, ops(2, (C, 0), (A, 1), (B, 1), (A, 0), (D, 1), (B, 0)))
    assert trace[0][2] == 10  # a1, our checkpoint
    assert trace[1][2] == 20  # a1 (the graph's now) + a2
    keeps_output = Stage("t", 10, 0, False, 10, 10, 10, 0, 0, 1.0, 1.0, saves_output=True)
    chain = Chain((keeps_output, keeps_output), input_bytes=10)
    trace = memory_trace(chain, ops(2, (A, 0), (A, 1), (B, 1), (B, 0)))
    assert trace[0][2] == 10  # a1: our reference and graph 0's, counted once
    assert trace[1][2] == 20  # a1 (graph 0's) + a2 (ours and graph 1's)


def test_a_released_graph_holds_nothing_of_its_input_until_its_backward_reads_it_again():
    # Three stages that save their inputs (linear layers). Stored: stage 1's graph holds a1
    # from Fa1 to B1. Released: Fr1 keeps a1 out of the graph (a1 is freed), Fa0 computes it
    # again just before B1, which reads it and drops it.
    keeps_input = Stage("s", 10, 0, True, 10, 10, 10, 0, 0, 1.0, 1.0)
    chain = Chain((keeps_input, keeps_input, keeps_input), input_bytes=10)
    R = Op.FORWARD_RELEASE
    released = ops(3, (C, 0), (R, 1), (A, 2), (B, 2), (A, 0), (B, 1), (B, 0))
    stored = ops(3, (C, 0), (A, 1), (A, 2), (B, 2), (B, 1), (A, 0), (B, 0))
    trace, kept = memory_trace(chain, released), memory_trace(chain, stored)
    assert trace[0][2] == kept[0][2] == 10  # a1 (a0 is the caller's)
    assert kept[1][2] == 20 and trace[1][2] == 10  # a2, and a1 only where stage 1 saved it
    assert trace[4][2] == trace[3][2] + 10  # Fa0: a1 again, ours
    assert trace[5][0] - trace[5][2] == kept[4][0] - kept[4][2]  # B1 drops a1 either way
    # Until B2 ends a1 is not held: less at the forward's end and B2's peak.
    assert max(d for _, d, _ in trace[:4]) == max(d for _, d, _ in kept[:4]) - 10
    cost = simulate(chain, released)
    assert cost.forward_all_steps == 3 and cost.seconds == 3 + 1 + 3  # stage 0 twice
    with pytest.raises(InvalidSchedule, match="Fr1 released it"):
        simulate(chain, ops(3, (C, 0), (R, 1), (A, 2), (B, 2), (B, 1), (A, 0), (B, 0)))
    # Recomputing a1 while a stored graph of stage 1 holds it would make a second copy.
    with pytest.raises(InvalidSchedule, match="already in memory"):
        simulate(chain, ops(3, (C, 0), (A, 1), (A, 2), (B, 2), (A, 0), (B, 1), (B, 0)))
    assert Schedule.from_dict(released.to_dict()).text() == "Fc0 Fr1 Fa2 B2 Fa0 B1 B0"


def test_a_stage_that_saves_neither_end_frees_its_input_and_output():
    # Between two Linear layers a Tanh-like stage saves its output, a BatchNorm-like one only
    # extra statistics: plain autograd frees such activations as soon as the next stage is done
    # with them, and so does the simulator.
    neither = Stage("n", 10, 2, False, 10, 12, 10, 0, 0, 1.0, 1.0)
    chain = Chain((neither, neither, neither), input_bytes=10)
    cost = simulate(chain, store_all(chain))
    # After the forward: three graphs of 2 bytes and the output a3 (10) held by the caller.
    assert memory_trace(chain, store_all(chain))[2][2] == 3 * 2 + 10
    # The loss adds the output gradient (10, held until the backward ends), B2 its input
    # gradient (10) for B1, whose transient peak adds 10 more; graphs that held their outputs
    # would have added a1 and a2 (20) on top.
    assert cost.peak_bytes == 16 - 2 + 10 + 10 + 10


@settings(max_examples=60, deadline=None)
@given(chains(max_length=12))
def test_every_planner_returns_a_valid_schedule_within_its_budget(chain):
    plain = simulate(chain, store_all(chain))
    for strategy in FRONTIER_STRATEGIES:
        fastest = plan(chain, strategy)
        assert simulate(chain, fastest).seconds <= plain.seconds * 3 + 1e-9 or strategy != "optimal"
        for factor in (1.0, 1.5, 2.5):
            try:
                schedule = plan(chain, strategy, max_recompute=factor)
            except Exception as exc:  # revolve cannot always reach small factors
                assert strategy != "optimal", exc
                continue
            assert simulate(chain, schedule).recompute_factor <= factor + 1e-9


def test_schedule_file_round_trip_and_corruption(tmp_path):
    chain = random_chain(random.Random(3), 6)
    schedule = plan(chain, "optimal", max_recompute=1.4)
    path = tmp_path / "plan.json"
    schedule.save(path)
    again = Schedule.load(path)
    assert again.text() == schedule.text()
    assert simulate(chain, again) == simulate(chain, schedule)

    data = json.loads(path.read_text())
    data["ops"] = data["ops"].replace("B0", "B1")
    path.write_text(json.dumps(data))
    with pytest.raises(CorruptFile, match="checksum"):
        Schedule.load(path)
    path.write_text("{ not json")
    with pytest.raises(CorruptFile, match="not valid JSON"):
        Schedule.load(path)
    with pytest.raises(CorruptFile, match="cannot read"):
        Schedule.load(tmp_path / "missing.json")


def test_saving_over_an_existing_plan_is_atomic(tmp_path):
    chain = uniform_chain(5)
    path = tmp_path / "plan.json"
    sequential(chain, 2).save(path)
    sequential(chain, 3).save(path)
    assert Schedule.load(path).params == {"segments": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temp files left behind


def test_a_graph_cannot_duplicate_an_activation_already_held():
    # Fa 1 would make a second copy of a[2] while the plain one from Fc 1 is still held.
    with pytest.raises(InvalidSchedule, match="already in memory"):
        simulate(uniform_chain(3), ops(3, (C, 0), (C, 1), (A, 1)))


def _spans(runs):
    return tuple((run.first, run.last) for run in runs)


def test_graph_runs_are_the_stages_stored_as_plain_autograd_would():
    assert graph_runs(store_all(uniform_chain(5))) == (GraphRun(0, 4),)
    F, B, C = Op.FORWARD_ALL, Op.BACKWARD, Op.FORWARD_CHECKPOINT
    # Stage 0 is checkpointed and recomputed just before its backward: a segment of one stage.
    ops = [(C, 0), (F, 1), (F, 2), (F, 3), (B, 3), (B, 2), (B, 1), (F, 0), (B, 0)]
    assert graph_runs(Schedule.from_ops(4, ops)) == (GraphRun(0, 3, checkpointed={(0, 0)}),)
    # Recomputed earlier than that, it is no unit: only 1..3 are stored.
    ops = [(C, 0), (F, 1), (F, 2), (F, 3), (B, 3), (F, 0), (B, 2), (B, 1), (B, 0)]
    assert graph_runs(Schedule.from_ops(4, ops)) == (GraphRun(1, 2),)
    # An operation between two forwards, or on the activation between two stages, splits a run.
    ops = [(F, 0), (F, 1), (Op.PAGE_OUT, 2), (F, 2), (F, 3), (Op.PAGE_IN, 2)]
    ops += [(B, 3), (B, 2), (B, 1), (B, 0)]
    assert _spans(graph_runs(Schedule.from_ops(4, ops))) == ((0, 1), (2, 3))
    # So does an operation between two backwards.
    ops = [(F, 0), (F, 1), (F, 2), (B, 2), (Op.DISCARD, 3), (B, 1), (B, 0)]
    assert _spans(graph_runs(Schedule.from_ops(3, ops))) == ((0, 1),)


def test_graph_runs_take_in_stages_whose_output_is_released_and_rebuilt():
    F, B, C, R = Op.FORWARD_ALL, Op.BACKWARD, Op.FORWARD_CHECKPOINT, Op.FORWARD_RELEASE
    # Fc 0, Fr 1 and, in the backward, Fa 0 again just before B 1: stage 0's output is
    # rebuilt for 1's backward, as compile recomputes a cheap operation.
    ops = [(C, 0), (R, 1), (F, 2), (B, 2), (F, 0), (B, 1), (B, 0)]
    assert graph_runs(Schedule.from_ops(3, ops)) == (GraphRun(0, 2, frozenset({0})),)
    ops = [(F, 0), (C, 1), (R, 2), (C, 3), (R, 4)]
    ops += [(F, 3), (B, 4), (B, 3), (F, 1), (B, 2), (B, 1), (B, 0)]
    assert graph_runs(Schedule.from_ops(5, ops)) == (GraphRun(0, 4, frozenset({1, 3})),)
    # The rebuild not just before the released stage's backward: no pair; and it splits 2..3.
    ops = [(C, 0), (R, 1), (F, 2), (F, 3), (B, 3), (F, 0), (B, 2), (B, 1), (B, 0)]
    assert graph_runs(Schedule.from_ops(4, ops)) == ()
    # A checkpoint paged out (named) is not held by a graph: the pair is not merged.
    ops = [(C, 0), (R, 1), (Op.PAGE_OUT, 0), (F, 2), (B, 2), (Op.PAGE_IN, 0), (F, 0)]
    ops += [(B, 1), (B, 0)]
    assert graph_runs(Schedule.from_ops(3, ops)) == ()


def _valid_run(schedule, first, last, recomputed, segments=frozenset()):
    """Checked from the definition, apart from graph_runs' own code: the run's operations are
    exactly its units' (Fa; Fc k, Fr k+1; or Fc i, Fn i+1 .. Fn j), adjacent in the forward,
    and their backwards (B; Fa k, B k+1, B k; or Fa i .. Fa j, perhaps D j+1, B j .. B i)
    adjacent in reverse, with no activation inside it named (but a segment's D j+1)."""
    segs = dict(segments)
    in_segment = {k for i, j in segs.items() for k in range(i, j + 1)}
    if first >= last or any(not first <= k < last for k in recomputed):
        return False
    if any(not first <= i <= j <= last for i, j in segs.items()):
        return False
    paired = set(recomputed) | {k + 1 for k in recomputed}
    if len(paired) != 2 * len(recomputed) or paired & in_segment:
        return False
    if sum(j - i + 1 for i, j in segs.items()) != len(in_segment):
        return False
    ops = list(schedule)
    forward = []
    for k in range(first, last + 1):
        if k in segs or k in recomputed:
            forward.append(Op.FORWARD_CHECKPOINT)
        elif k in in_segment:
            forward.append(Op.FORWARD_NOSAVE)
        elif k - 1 in recomputed:
            forward.append(Op.FORWARD_RELEASE)
        else:
            forward.append(Op.FORWARD_ALL)
    ends = {j: i for i, j in segs.items()}
    backward, absorbed = [], set()
    k = last
    while k >= first:
        if k in ends:
            i = ends[k]
            backward += [(Op.FORWARD_ALL, m) for m in range(i, k + 1)]
            at = [p for p, op in enumerate(ops) if op == (Op.FORWARD_ALL, k)]
            if at and at[0] + 1 < len(ops) and ops[at[0] + 1] == (Op.DISCARD, k + 1):
                backward.append((Op.DISCARD, k + 1))
                absorbed.add(at[0] + 1)
            backward += [(Op.BACKWARD, m) for m in range(k, i - 1, -1)]
            k = i - 1
            continue
        if k - 1 in recomputed:
            backward.append((Op.FORWARD_ALL, k - 1))
        backward.append((Op.BACKWARD, k))
        k -= 1
    rebuilt_first = first in recomputed or first in segs
    inner = set(range(first + 1, last + 1))
    named_kinds = (Op.DISCARD, Op.PAGE_OUT, Op.PAGE_IN)
    held = [p for p, (kind, k) in enumerate(ops) if kind not in named_kinds and k == first]
    mine = [
        (position, kind, k)
        for position, (kind, k) in enumerate(ops)
        if position in absorbed
        or (kind in named_kinds and k in inner)
        or (kind in named_kinds and rebuilt_first and k == first and held[0] < position < held[-1])
        or (kind not in named_kinds and first <= k <= last)
    ]
    expected = list(zip(forward, range(first, last + 1), strict=True)) + backward
    if [(kind, k) for _, kind, k in mine] != expected:
        return False
    positions = [p for p, _, _ in mine]
    split = len(forward)
    return all(b == a + 1 for a, b in itertools.pairwise(positions[:split])) and all(
        b == a + 1 for a, b in itertools.pairwise(positions[split:])
    )


@given(chains(max_length=12))
@settings(max_examples=60, deadline=None)
def test_graph_runs_of_planned_schedules_are_maximal_and_sound(chain):
    plain = simulate(chain, store_all(chain)).peak_bytes
    n = chain.length
    for fraction in (1.0, 0.8, 0.6, 0.4, 0.25):
        try:
            schedule = plan(chain, "optimal", memory=fraction * plain)
        except InfeasibleBudget:
            continue
        runs = graph_runs(schedule)
        assert all(a.last < b.first for a, b in itertools.pairwise(runs))
        for run in runs:
            assert _valid_run(schedule, run.first, run.last, run.recomputed, run.checkpointed)
            # Maximal: no unit before it (a stage, a pair, a segment) nor after it joins it.
            before = [(run.first - 1, set(), set()), (run.first - 2, {run.first - 2}, set())]
            before += [(i, set(), {(i, run.first - 1)}) for i in range(run.first)]
            for start, pair, segment in before:
                assert not _valid_run(
                    schedule, start, run.last, run.recomputed | pair, run.checkpointed | segment
                )
            after = [(run.last + 1, set(), set()), (run.last + 2, {run.last + 1}, set())]
            after += [(j, set(), {(run.last + 1, j)}) for j in range(run.last + 1, n)]
            for end, pair, segment in after:
                assert not _valid_run(
                    schedule, run.first, end, run.recomputed | pair, run.checkpointed | segment
                )
        covered = {k for run in runs for k in range(run.first, run.last + 1)}
        for k in range(n - 1):  # no run of two stages left out
            if k not in covered and k + 1 not in covered:
                assert not _valid_run(schedule, k, k + 1, set())
                assert not _valid_run(schedule, k, k + 1, {k})
                assert not _valid_run(schedule, k, k + 1, set(), {(k, k + 1)})


def test_merged_schedule_renumbers_a_plan_onto_its_merged_runs():
    F, B, C = Op.FORWARD_ALL, Op.BACKWARD, Op.FORWARD_CHECKPOINT
    ops = [(C, 0), (F, 1), (F, 2), (F, 3), (B, 3), (B, 2), (B, 1), (F, 0), (B, 0)]
    first, merged = merged_schedule(Schedule.from_ops(4, ops), [GraphRun(1, 3)])
    assert first == [0, 1]
    assert list(merged) == [(C, 0), (F, 1), (B, 1), (F, 0), (B, 0)]
    assert merged.length == 2 and merged.forward_phase_end == 2
    # A run with a rebuilt output: its Fc, Fr and the Fa again go; one Fa and one B stay.
    R = Op.FORWARD_RELEASE
    ops = [(C, 0), (R, 1), (F, 2), (B, 2), (F, 0), (B, 1), (B, 0)]
    first, merged = merged_schedule(Schedule.from_ops(3, ops), [GraphRun(0, 1, frozenset({0}))])
    assert first == [0, 2]
    assert list(merged) == [(F, 0), (F, 1), (B, 1), (B, 0)]
    # An operation on a run's input stays, on the merged stage's input.
    ops = [(C, 0), (F, 1), (F, 2), (B, 2), (B, 1), (Op.DISCARD, 1), (F, 0), (B, 0)]
    first, merged = merged_schedule(Schedule.from_ops(3, ops), [GraphRun(1, 2)])
    assert first == [0, 1]
    assert list(merged) == [(C, 0), (F, 1), (B, 1), (Op.DISCARD, 1), (F, 0), (B, 0)]
    unchanged = Schedule.from_ops(4, ops)
    first, same = merged_schedule(unchanged, [])
    assert first == [0, 1, 2, 3] and list(same) == list(unchanged)


def test_a_graph_run_without_some_of_its_pairs_leaves_the_runs_between_them():
    run = GraphRun(0, 10, frozenset({3, 7}))
    assert run.pairs() == (GraphRun(3, 4, frozenset({3})), GraphRun(7, 8, frozenset({7})))
    assert run.without({3}) == (GraphRun(0, 2), GraphRun(5, 10, frozenset({7})))
    assert run.without(run.recomputed) == (GraphRun(0, 2), GraphRun(5, 6), GraphRun(9, 10))
    assert run.without(set()) == (run,)
    # A single stage left between two pairs is no run.
    assert GraphRun(0, 4, frozenset({0, 3})).without({0, 3}) == ()


def test_graph_runs_take_in_checkpointed_segments():
    F, B, C, N, D = (
        Op.FORWARD_ALL,
        Op.BACKWARD,
        Op.FORWARD_CHECKPOINT,
        Op.FORWARD_NOSAVE,
        Op.DISCARD,
    )
    # Stages 1..3 run without their graphs, from 1's input, and again with them (what
    # torch.utils.checkpoint does); the output of 3 they compute again is dropped (D 4).
    ops = [(F, 0), (C, 1), (N, 2), (N, 3), (F, 4), (B, 4)]
    ops += [(F, 1), (F, 2), (F, 3), (D, 4), (B, 3), (B, 2), (B, 1), (B, 0)]
    schedule = Schedule.from_ops(5, ops)
    run = GraphRun(0, 4, checkpointed=frozenset({(1, 3)}))
    assert graph_runs(schedule) == (run,)
    assert _valid_run(schedule, 0, 4, set(), {(1, 3)})
    # As one stage: the D goes with the segment's operations.
    first, merged = merged_schedule(schedule, [run])
    assert first == [0] and list(merged) == [(F, 0), (B, 0)]
    # Without the D, the same segment.
    ops.remove((D, 4))
    assert graph_runs(Schedule.from_ops(5, ops)) == (run,)
    # A nested recomputation inside (Fc 2 in the backward) is no segment: 1..3 split the run.
    ops = [(F, 0), (C, 1), (N, 2), (N, 3), (F, 4), (B, 4)]
    ops += [(F, 1), (C, 2), (F, 3), (B, 3), (F, 2), (B, 2), (B, 1), (B, 0)]
    assert graph_runs(Schedule.from_ops(5, ops)) == ()
    # A D on an activation inside the segment, other than its own, splits the run too.
    ops = [(F, 0), (C, 1), (N, 2), (N, 3), (F, 4), (B, 4)]
    ops += [(F, 1), (F, 2), (D, 2), (F, 3), (B, 3), (B, 2), (B, 1), (B, 0)]
    assert graph_runs(Schedule.from_ops(5, ops)) == ()


def test_a_graph_run_without_its_segments_leaves_the_runs_between_them():
    run = GraphRun(0, 12, frozenset({1}), frozenset({(4, 7), (10, 10)}))
    assert run.rebuilds == {1, 4, 10}
    assert run.pairs() == (
        GraphRun(1, 2, frozenset({1})),
        GraphRun(4, 7, checkpointed=frozenset({(4, 7)})),
    )
    assert run.without({4}) == (
        GraphRun(0, 3, frozenset({1})),
        GraphRun(8, 12, checkpointed=frozenset({(10, 10)})),
    )
    # 0 and 3 are left alone, no run.
    assert run.without(run.rebuilds) == (GraphRun(8, 9), GraphRun(11, 12))
