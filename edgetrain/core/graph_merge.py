"""Graph runs: stages of a plan the executor may run as one autograd graph
(:func:`graph_runs`), and the plan on those merged stages (:func:`merged_schedule`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edgetrain.core.schedule import Op, Schedule


@dataclass(frozen=True)
class GraphRun:
    """Stages ``first`` .. ``last`` that the executor may run as one autograd graph.

    Attributes:
        first, last: the run's first and last stage (inclusive).
        recomputed: stages whose output the graph does not hold: the plan runs ``Fc k`` then
            ``Fr k+1`` and, in the backward, ``Fa k`` again just before ``B k+1``, to have the
            output again when ``k+1``'s backward reads it. As one graph, ``k`` is run with grad
            once, and its output is computed again from its (held) input when the backward
            reads it (the :class:`~edgetrain.autograd.replay.GraphRunModule` recipe).
        checkpointed: segments ``(k, j)`` of stages whose graphs the plan does not keep: it runs
            ``Fc k, Fn k+1 .. Fn j`` and, in the backward, ``Fa k .. Fa j`` then ``B j .. B k``.
            As one graph, the segment runs under :func:`torch.utils.checkpoint.checkpoint`
            (non-reentrant): its input is held, what its operations save is computed again,
            all at once, when the backward first reads it.
    """

    first: int
    last: int
    recomputed: frozenset[int] = frozenset()
    checkpointed: frozenset[tuple[int, int]] = frozenset()

    @property
    def rebuilds(self) -> frozenset[int]:
        """The first stage of each unit that computes something again (a recomputed pair's
        ``k``, a checkpointed segment's ``k``)."""
        return self.recomputed | {k for k, _ in self.checkpointed}

    @property
    def rebuilt_stages(self) -> int:
        """How many stages the run computes again: each recomputed pair's first, each
        checkpointed segment's every stage."""
        return len(self.recomputed) + sum(j - k + 1 for k, j in self.checkpointed)

    def pairs(self) -> tuple[GraphRun, ...]:
        """Each recomputed pair ``(k, k+1)``, and each checkpointed segment of two or more
        stages, as a run of its own."""
        own = [GraphRun(k, k + 1, frozenset({k})) for k in self.recomputed]
        own += [
            GraphRun(k, j, checkpointed=frozenset({(k, j)})) for k, j in self.checkpointed if j > k
        ]
        return tuple(sorted(own, key=lambda run: run.first))

    def without(self, dropped: frozenset[int] | set[int]) -> tuple[GraphRun, ...]:
        """The runs of two or more of its stages left when the units that rebuild and begin at
        a stage of ``dropped`` (see :attr:`rebuilds`) are taken out (they run stage by stage)."""
        spans = {k: k + 1 for k in self.recomputed} | dict(self.checkpointed)
        out = {i for k in dropped for i in range(k, spans[k] + 1)}
        parts: list[GraphRun] = []
        start = None
        for k in range(self.first, self.last + 2):
            if k <= self.last and k not in out:
                start = k if start is None else start
                continue
            if start is not None and k - 1 > start:
                kept = frozenset(j for j in self.recomputed if start <= j < k - 1)
                segments = frozenset((i, j) for i, j in self.checkpointed if start <= i and j < k)
                parts.append(GraphRun(start, k - 1, kept, segments))
            start = None
        return tuple(parts)


def graph_runs(schedule: Schedule) -> tuple[GraphRun, ...]:
    """The maximal runs of two or more consecutive stages the executor may run as one graph.

    A run is a sequence of *units*, each on the stage(s) right after the previous unit's:

    * a stored stage: ``Fa k`` in the forward, ``B k`` in the backward, nothing else;
    * a recomputed pair: ``Fc k, Fr k+1`` in the forward, ``Fa k, B k+1, B k`` in the
      backward, nothing else (the output of ``k`` is released from ``k+1``'s graph and
      rebuilt for its backward: what ``torch.compile``'s partitioner does for cheap operations);
    * a checkpointed segment: ``Fc k, Fn k+1 .. Fn j`` in the forward, ``Fa k .. Fa j``, then
      perhaps ``D j+1`` (the output computed again, which the plan already holds), then
      ``B j .. B k`` in the backward, nothing else (what ``torch.utils.checkpoint`` does).

    Each unit's forward operations follow the previous unit's, and its backward operations come
    just before the previous unit's (adjacent, in reverse). No ``D``, ``Po`` or ``Pi`` names an
    activation inside the run (nor its input while the run holds it, from its first forward to its
    last backward, when its first stage is recomputed), other than a segment's own ``D j+1``.

    One graph and one engine call replace one per stage (about 60-95 µs of Python and autograd
    each on this machine, ``benchmarks/executor_overhead.py --per-stage``), and a recomputed
    stage's output is rebuilt without building its graph a second time. One graph need not hold
    at its backward's peak what the stages hold one by one, so the executor sizes the merged
    stages before it merges them (:class:`~edgetrain.runtime.checkpointed.Checkpointed`).
    """
    ops = _Operations(schedule)
    segments = ops.segments
    runs: list[GraphRun] = []
    k = 0
    while k < schedule.length:
        begun = ops.unit(k)
        if begun is None or ((k in segments or begun[0] > k) and ops.named_within(k, begun)):
            k += 1
            continue
        last, _, forward_end, backward_start, _ = begun
        recomputed = {k} if last > k and k not in segments else set()
        while last + 1 < schedule.length and not ops.is_named(last + 1):
            following = ops.unit(last + 1)
            if following is None:
                break
            end, f_first, f_last, b_first, b_last = following
            if f_first != forward_end + 1 or b_last != backward_start - 1:
                break
            if end > last + 1 and last + 1 not in segments:
                recomputed.add(last + 1)
            last, forward_end, backward_start = end, f_last, b_first
        if last > k:
            inside = frozenset((i, j) for i, j in segments.items() if k <= i <= last)
            runs.append(GraphRun(k, last, frozenset(recomputed), inside))
        k = last + 1
    return tuple(runs)


class _Operations:
    """A schedule's operations indexed for :func:`graph_runs`: by the stage each runs, and the
    positions of the ``D``, ``Po`` and ``Pi`` naming each activation."""

    RECOMPUTES = (Op.FORWARD_CHECKPOINT, Op.FORWARD_ALL, Op.BACKWARD)

    def __init__(self, schedule: Schedule) -> None:
        self.touched: dict[int, list[tuple[Op, int]]] = {}
        self.named: dict[int, set[int]] = {}  # activation -> positions of the D, Po, Pi naming it
        self.ops = list(schedule)
        for position, (kind, k) in enumerate(self.ops):
            if kind.names_activation:
                self.named.setdefault(k, set()).add(position)
            else:
                self.touched.setdefault(k, []).append((kind, position))
        self.absorbed: set[int] = set()  # positions of segments' own D j+1
        self.segments: dict[int, int] = {}  # first -> last stage of each checkpointed segment

    def is_named(self, k: int) -> bool:
        return bool(self.named.get(k, set()) - self.absorbed)

    def named_within(self, k: int, first_unit: tuple[int, int, int, int, int]) -> bool:
        """Whether activation k is named while the unit beginning at k holds it (from its
        first forward to its last backward operation)."""
        named = self.named.get(k, set()) - self.absorbed
        return any(first_unit[1] < p < first_unit[4] for p in named)

    def kinds(self, k: int) -> tuple[Op, ...]:
        return tuple(kind for kind, _ in self.touched.get(k, []))

    def positions(self, k: int) -> list[int]:
        return [position for _, position in self.touched[k]]

    def segment(self, k: int) -> tuple[int, int, int, int, int, int | None] | None:
        """The checkpointed segment beginning at k, as :meth:`unit`'s tuple and the position of
        its ``D j+1`` (or None), or None."""
        ops, kinds, positions = self.ops, self.kinds, self.positions
        f0, a0, _ = positions(k)
        j = k
        while kinds(j + 1) == (Op.FORWARD_NOSAVE, Op.FORWARD_ALL, Op.BACKWARD):
            f, a, _ = positions(j + 1)
            if f != f0 + j + 1 - k or a != a0 + j + 1 - k or self.is_named(j + 1):
                break
            j += 1
        after = a0 + j - k + 1  # right after Fa j
        discard = None
        if after < len(ops) and ops[after] == (Op.DISCARD, j + 1):
            discard, after = after, after + 1
        if any(positions(i)[2] != after + j - i for i in range(k, j + 1)):
            return None
        return j, f0, f0 + j - k, a0, after + j - k, discard

    def unit(self, k: int) -> tuple[int, int, int, int, int] | None:
        """The unit beginning at stage k as (its last stage, the positions of its first and
        last forward and of its first and last backward operation), or None."""
        touched, kinds = self.touched, self.kinds
        if kinds(k) == (Op.FORWARD_ALL, Op.BACKWARD):
            (_, f), (_, b) = touched[k]
            return k, f, f, b, b
        if kinds(k) != self.RECOMPUTES:
            return None
        if kinds(k + 1) == (Op.FORWARD_RELEASE, Op.BACKWARD):
            (_, f0), (_, again), (_, b0) = touched[k]
            (_, f1), (_, b1) = touched[k + 1]
            if f1 == f0 + 1 and b1 == again + 1 and b0 == b1 + 1 and not self.is_named(k + 1):
                return k + 1, f0, f1, again, b0
            return None
        found = self.segment(k)
        if found is None:
            return None
        *span, discard = found
        if discard is not None:
            self.absorbed.add(discard)
        self.segments[k] = span[0]
        return span[0], span[1], span[2], span[3], span[4]


def merged_schedule(schedule: Schedule, runs: Sequence[GraphRun]) -> tuple[list[int], Schedule]:
    """``schedule`` with each run of :func:`graph_runs` as one stage: the stage of ``schedule``
    each stage begins with, and the operations on the new stages (a run's ``Fa`` where its
    first forward was, its ``B`` where its first backward operation was; an activation's index
    is that of the stage it enters)."""
    ends = {run.first: run.last for run in runs}
    first: list[int] = []
    at: dict[int, int] = {}  # stage (or activation) of ``schedule`` -> the stage it begins
    k = 0
    while k < schedule.length:
        at[k] = len(first)
        first.append(k)
        k = ends.get(k, k) + 1
    at[schedule.length] = len(first)
    inside = {i: run for run in runs for i in range(run.first, run.last + 1)}
    segment_ends = {j for run in runs for _, j in run.checkpointed}
    began: set[int] = set()  # runs whose forward, and whose backward, is placed
    ended: set[int] = set()
    ops: list[tuple[Op, int]] = []
    before: tuple[Op, int] | None = None
    for kind, k in schedule:
        previous, before = before, (kind, k)
        if kind is Op.DISCARD and k - 1 in segment_ends and previous == (Op.FORWARD_ALL, k - 1):
            continue  # a segment's D j+1: its output computed again, which one graph does not
        run = inside.get(k)
        if run is None or kind.names_activation:
            ops.append((kind, at[k]))  # a run's input, at most (graph_runs names none inside)
        elif kind.is_forward and run.first not in began:
            began.add(run.first)
            ops.append((Op.FORWARD_ALL, at[run.first]))
        elif kind is Op.BACKWARD and run.first not in ended:
            ended.add(run.first)
            ops.append((Op.BACKWARD, at[run.first]))
    merged = Schedule.from_ops(len(first), ops, schedule.strategy, schedule.params)
    return first, merged
