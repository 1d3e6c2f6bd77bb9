"""Schedule: one plan type for every planner, and the simulator that replays it.

A schedule is a sequence of operations on a :class:`~edgetrain.core.chain.Chain` of ``L`` stages
whose
activations are ``a[0]`` (the input) .. ``a[L]`` (the output):

==================  =====================================================================
``Fn k``            forward stage ``k`` without grad; ``a[k+1]`` is kept, our reference to
                    ``a[k]`` is dropped (forward *without saving*)
``Fc k``            forward stage ``k`` without grad, keeping ``a[k]`` as a checkpoint
``Fa k``            forward stage ``k`` with grad, building its graph (what autograd saves);
                    ``a[k+1]`` is kept, our reference to ``a[k]`` is dropped
``Fr k``            as ``Fa k``, but the graph *releases* the stage's input: what autograd saves
                    of ``a[k]`` is not held; ``a[k]`` must be held again (recomputed by the
                    stage before) when ``B k`` runs, which reads it there and drops it
``B k``             backward of stage ``k``: needs the graph of ``k`` and the gradient of
                    ``a[k+1]`` (and ``a[k]`` after an ``Fr k``); leaves the gradient of
                    ``a[k]`` and the parameter gradients it creates, and frees the graph
``D k``             discard our reference to ``a[k]``
``Po k``            page ``a[k]`` out to a file (a background write that overlaps the next
                    operation; the memory is freed when that operation ends)
``Pi k``            page ``a[k]`` back in from its file, as our reference
==================  =====================================================================

The *forward phase* is everything before the first ``B``; it must have built the graph of the last
stage, whose output is handed to the caller, who holds it until the step ends and computes the
loss; the output's gradient, handed back by autograd, is held until the backward ends. The
backward phase must run ``B L-1``, ``B L-2`` .. ``B 0`` in that order.

:func:`simulate` replays a schedule on a chain and returns its :class:`Cost`. Memory is counted the
way the executor (:mod:`edgetrain.runtime.checkpointed`) and autograd hold it: an activation's
storage is held
while our reference, a graph that saved it as its input, or a graph that saved it as its output
refers to it, and is counted once; a graph holds only what autograd saved; a stage run forward
again works on copies of all its buffers
(:attr:`~edgetrain.core.chain.Stage.recompute_buffer_bytes`;
the executor keeps BatchNorm's running statistics from being updated twice), held during the
operation and, after an ``Fa``, by its graph until its ``B``; a stage whose result depends on
buffers its forward changes, run more than once, holds a snapshot of them (those bytes again)
from its first run to its last; what a stage keeps past its run
(:attr:`~edgetrain.core.chain.Stage.retained_bytes`) is held from its first run to the step's end;
each operation adds its measured transient peak; parameter gradients appear as the backward
creates them and stay until the step ends (unless ``grads_exist``: then they were held before the
step and are added to in place). The input ``a[0]``, the weights and the buffers are held before
the step and are not counted.

Recompute factor convention: ``recompute_factor = seconds / (forward_seconds + backward_seconds)``
of the chain, i.e. the time of the schedule over the time of one plain forward and backward. On a
chain of ``l`` equal stages whose forward and backward each cost one unit this is the paper's count:
a schedule with ``ρ`` performs ``2ρl`` forward and backward computations.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

from edgetrain.core.chain import Chain
from edgetrain.errors import CorruptFile, InvalidSchedule
from edgetrain.jsonfile import MAX_INT_DIGITS, read_json

FORMAT = "edgetrain-schedule"
VERSION = 1


class Op(IntEnum):
    """Operation kinds (see the module docstring)."""

    FORWARD_NOSAVE = 0
    FORWARD_CHECKPOINT = 1
    FORWARD_ALL = 2
    BACKWARD = 3
    DISCARD = 4
    PAGE_OUT = 5
    PAGE_IN = 6
    FORWARD_RELEASE = 7

    @property
    def builds_graph(self) -> bool:
        """``Fa`` or ``Fr``: a forward with grad."""
        return self in (Op.FORWARD_ALL, Op.FORWARD_RELEASE)

    @property
    def is_forward(self) -> bool:
        """Any forward: ``Fn``, ``Fc``, ``Fa`` or ``Fr``."""
        return self in _FORWARD_KINDS

    @property
    def names_activation(self) -> bool:
        """``D``, ``Po`` or ``Pi``: its index names an activation, not a stage."""
        return self in (Op.DISCARD, Op.PAGE_OUT, Op.PAGE_IN)

    @property
    def code(self) -> str:
        """Short name used in text and JSON: Fn, Fc, Fa, Fr, B, D, Po, Pi."""
        return _CODES[self]


_CODES = {
    Op.FORWARD_NOSAVE: "Fn",
    Op.FORWARD_CHECKPOINT: "Fc",
    Op.FORWARD_ALL: "Fa",
    Op.BACKWARD: "B",
    Op.DISCARD: "D",
    Op.PAGE_OUT: "Po",
    Op.PAGE_IN: "Pi",
    Op.FORWARD_RELEASE: "Fr",
}
_FORWARD_KINDS = frozenset(
    (Op.FORWARD_NOSAVE, Op.FORWARD_CHECKPOINT, Op.FORWARD_ALL, Op.FORWARD_RELEASE)
)
_BY_CODE = {code: op for op, code in _CODES.items()}


@dataclass(frozen=True, eq=False)
class Schedule:
    """A plan: ``kinds[i]`` is an :class:`Op`, ``indices[i]`` its stage (or activation for ``D``).

    Stored as two integer arrays so that a 100 000-step revolve plan stays small and fast.

    Attributes:
        length: the number of stages of the chain it was made for.
        kinds: operation kinds (int8 array of :class:`Op` values).
        indices: stage index of each ``Fn``/``Fc``/``Fa``/``B``, activation index of each ``D``.
        strategy: the planner that made it ("sequential", "revolve", "optimal", ...).
        params: the planner's parameters (segments, slots, budget ...), JSON-ready.
    """

    length: int
    kinds: np.ndarray
    indices: np.ndarray
    strategy: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_ops(
        cls,
        length: int,
        ops: Sequence[tuple[Op, int]],
        strategy: str = "",
        params: dict[str, Any] | None = None,
    ) -> Schedule:
        """Build a schedule from ``(Op, index)`` pairs."""
        kinds = np.fromiter((int(k) for k, _ in ops), dtype=np.int8, count=len(ops))
        indices = np.fromiter((i for _, i in ops), dtype=np.int64, count=len(ops))
        return cls(length, kinds, indices, strategy, dict(params or {}))

    def __len__(self) -> int:
        return int(self.kinds.shape[0])

    def __iter__(self) -> Iterator[tuple[Op, int]]:
        for kind, index in zip(self.kinds.tolist(), self.indices.tolist(), strict=True):
            yield Op(kind), index

    def count(self, *kinds: Op) -> int:
        """How many operations are of the given kinds."""
        return int(np.isin(self.kinds, [int(k) for k in kinds]).sum())

    @property
    def forward_steps(self) -> int:
        """Forward computations without grad (``Fn`` + ``Fc``): pyrevolve's ``numforw``.

        The forwards with grad are not counted: each is fused with the backward that follows it.
        """
        return self.count(Op.FORWARD_NOSAVE, Op.FORWARD_CHECKPOINT)

    @property
    def forward_phase_end(self) -> int:
        """Index of the first backward: the operations before it run in the forward pass."""
        hits = np.flatnonzero(self.kinds == int(Op.BACKWARD))
        return int(hits[0]) if hits.size else len(self)

    def text(self) -> str:
        """Space-separated ops, e.g. ``"Fc0 Fn1 Fa2 B2 ..."``."""
        return " ".join(f"{Op(k).code}{i}" for k, i in zip(self.kinds, self.indices, strict=True))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, with a checksum of the operations (see :func:`load_schedule`)."""
        ops = self.text()
        return {
            "format": FORMAT,
            "version": VERSION,
            "length": self.length,
            "strategy": self.strategy,
            "params": self.params,
            "ops": ops,
            "sha256": hashlib.sha256(ops.encode()).hexdigest(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Schedule:
        """Inverse of :meth:`to_dict`; raises :class:`CorruptFile` on any damage."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CorruptFile("not an edgetrain schedule; write one with Schedule.save")
        if data.get("version") != VERSION:
            raise CorruptFile(
                f"schedule format version {data.get('version')!r} is not {VERSION}; re-plan it"
            )
        ops = data.get("ops")
        if not isinstance(ops, str) or hashlib.sha256(ops.encode()).hexdigest() != data.get(
            "sha256"
        ):
            raise CorruptFile("schedule checksum does not match its operations; re-plan it")
        try:
            pairs = [_parse_op(token) for token in ops.split()]
            length = int(data["length"])
            params = dict(data.get("params") or {})
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptFile(f"schedule does not parse ({exc}); re-plan it") from exc
        return cls.from_ops(length, pairs, str(data.get("strategy", "")), params)

    def save(self, path: str | Path) -> None:
        """Write the schedule as JSON, atomically (temp file, fsync, rename)."""
        atomic_write_text(Path(path), json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        """Read a schedule written by :meth:`save`; raises :class:`CorruptFile` if damaged."""
        data = read_json(path, "schedule", "re-plan it", unreadable=CorruptFile)
        try:
            return cls.from_dict(data)
        except CorruptFile as exc:
            raise CorruptFile(f"schedule {path}: {exc}") from exc


def _parse_op(token: str) -> tuple[Op, int]:
    code = token.rstrip("0123456789")
    if code not in _BY_CODE or code == token:
        raise ValueError(f"unknown operation {token!r}")
    if len(token) - len(code) > MAX_INT_DIGITS:
        raise ValueError(f"operation {token[:40]!r} has an index beyond any chain")
    return _BY_CODE[code], int(token[len(code) :])


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a crash leaves either the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes, *, sync_directory: bool = True) -> None:
    """Write ``data`` to ``path`` (temp file, fsync, rename): a crash leaves the old file or the
    new one, never part of one. ``sync_directory`` also flushes the rename itself to disk (a
    file that must outlive a power cut; a page deleted after the step needs no such thing)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if not sync_directory:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True)
class Cost:
    """What a schedule costs on a chain.

    Attributes:
        peak_bytes: most memory the step holds at any moment above what was held before it
            (weights, buffers, input, existing gradients): activations, graphs, activation
            gradients, the parameter gradients it creates, transient peaks included.
        seconds: the schedule's compute time: the sum of its operations' stage times.
        recompute_factor: ``seconds`` over the time of one plain forward and backward.
        forward_steps: forwards without grad (``Fn`` + ``Fc``).
        forward_all_steps: forwards with grad (``Fa`` and ``Fr``).
        max_checkpoints: most activations held as checkpoints at once (the input not counted).
        peak_op: index of the operation at which the peak occurs.
        pages_out / pages_in: paging operations (``Po`` / ``Pi``).
        paged_bytes: bytes written by the page-outs.
    """

    peak_bytes: int
    seconds: float
    recompute_factor: float
    forward_steps: int
    forward_all_steps: int
    max_checkpoints: int
    peak_op: int
    pages_out: int = 0
    pages_in: int = 0
    paged_bytes: int = 0


def simulate(chain: Chain, schedule: Schedule, *, grads_exist: bool = False) -> Cost:
    """Replay ``schedule`` on ``chain``: validate it and return its :class:`Cost`.

    ``grads_exist``: the parameters' gradients exist before the step and are added to in place
    (``zero_grad(set_to_none=False)``); by default they do not (PyTorch's ``zero_grad()``) and the
    backward creates them. Raises :class:`InvalidSchedule` naming the first operation that cannot
    run (a forward whose input is gone, a stage run twice with grad, a backward out of order, ...).

    The store-all plan is plain autograd (the executor runs the stages as they are): when the
    chain carries that step's measured peak (:attr:`Chain.autograd_peak_bytes`), it is the plan's
    ``peak_bytes``; the replay counts every other plan, which the executor runs stage by stage.
    """
    cost = _replay(chain, schedule, None, grads_exist)
    measured = chain.autograd_peak_bytes
    if measured is not None and stores_everything(schedule):
        return replace(cost, peak_bytes=measured[1] if grads_exist else measured[0])
    return cost


def store_all_operations(length: int) -> tuple[np.ndarray, np.ndarray]:
    """Plain autograd's plan for ``length`` stages as :class:`Schedule` arrays ``(kinds,
    indices)``: every stage forward with its graph in order, then every backward in reverse."""
    kinds = np.repeat(np.array([int(Op.FORWARD_ALL), int(Op.BACKWARD)], dtype=np.int8), length)
    indices = np.concatenate([np.arange(length), np.arange(length - 1, -1, -1)])
    return kinds, indices.astype(np.int64)


def stores_everything(schedule: Schedule) -> bool:
    """Whether ``schedule`` is plain autograd's plan (:func:`store_all_operations`)."""
    if len(schedule) != 2 * schedule.length:
        return False
    kinds, indices = store_all_operations(schedule.length)
    return bool(np.array_equal(schedule.kinds, kinds) and np.array_equal(schedule.indices, indices))


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
    touched: dict[int, list[tuple[Op, int]]] = {}
    named: dict[int, set[int]] = {}  # activation -> positions of the D, Po, Pi naming it
    ops = list(schedule)
    for position, (kind, k) in enumerate(ops):
        if kind.names_activation:
            named.setdefault(k, set()).add(position)
        else:
            touched.setdefault(k, []).append((kind, position))
    absorbed: set[int] = set()  # positions of segments' own D j+1

    def is_named(k: int) -> bool:
        return bool(named.get(k, set()) - absorbed)

    def named_within(k: int, first_unit: tuple[int, int, int, int, int]) -> bool:
        """Whether activation k is named while the unit beginning at k holds it (from its
        first forward to its last backward operation)."""
        return any(first_unit[1] < p < first_unit[4] for p in named.get(k, set()) - absorbed)

    def kinds(k: int) -> tuple[Op, ...]:
        return tuple(kind for kind, _ in touched.get(k, []))

    def positions(k: int) -> list[int]:
        return [position for _, position in touched[k]]

    recomputes = (Op.FORWARD_CHECKPOINT, Op.FORWARD_ALL, Op.BACKWARD)

    def segment(k: int) -> tuple[int, int, int, int, int, int | None] | None:
        """The checkpointed segment beginning at k, as :func:`unit`'s tuple and the position of
        its ``D j+1`` (or None), or None."""
        f0, a0, _ = positions(k)
        j = k
        while kinds(j + 1) == (Op.FORWARD_NOSAVE, Op.FORWARD_ALL, Op.BACKWARD):
            f, a, _ = positions(j + 1)
            if f != f0 + j + 1 - k or a != a0 + j + 1 - k or is_named(j + 1):
                break
            j += 1
        after = a0 + j - k + 1  # right after Fa j
        discard = None
        if after < len(ops) and ops[after] == (Op.DISCARD, j + 1):
            discard, after = after, after + 1
        if any(positions(i)[2] != after + j - i for i in range(k, j + 1)):
            return None
        return j, f0, f0 + j - k, a0, after + j - k, discard

    def unit(k: int) -> tuple[int, int, int, int, int] | None:
        """The unit beginning at stage k as (its last stage, the positions of its first and
        last forward and of its first and last backward operation), or None."""
        if kinds(k) == (Op.FORWARD_ALL, Op.BACKWARD):
            (_, f), (_, b) = touched[k]
            return k, f, f, b, b
        if kinds(k) != recomputes:
            return None
        if kinds(k + 1) == (Op.FORWARD_RELEASE, Op.BACKWARD):
            (_, f0), (_, again), (_, b0) = touched[k]
            (_, f1), (_, b1) = touched[k + 1]
            if f1 == f0 + 1 and b1 == again + 1 and b0 == b1 + 1 and not is_named(k + 1):
                return k + 1, f0, f1, again, b0
            return None
        found = segment(k)
        if found is None:
            return None
        *span, discard = found
        if discard is not None:
            absorbed.add(discard)
        segments[k] = span[0]
        return span[0], span[1], span[2], span[3], span[4]

    segments: dict[int, int] = {}  # first -> last stage of each checkpointed segment found
    runs: list[GraphRun] = []
    k = 0
    while k < schedule.length:
        begun = unit(k)
        if begun is None or ((k in segments or begun[0] > k) and named_within(k, begun)):
            k += 1
            continue
        last, _, forward_end, backward_start, _ = begun
        recomputed = {k} if last > k and k not in segments else set()
        while last + 1 < schedule.length and not is_named(last + 1):
            following = unit(last + 1)
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


def memory_trace(
    chain: Chain, schedule: Schedule, *, grads_exist: bool = False
) -> list[tuple[int, int, int]]:
    """Per operation: bytes held before it, peak bytes during it, bytes held after it."""
    trace: list[tuple[int, int, int]] = []
    _replay(chain, schedule, trace, grads_exist)
    return trace


@dataclass(frozen=True)
class ReplayState:
    """What the replay holds just before one operation runs (see :func:`replay_state`).

    Attributes:
        index: the operation's position in the schedule.
        held_bytes: everything held then (above what the step started with).
        sizes: bytes of each storage ("piece"); pieces[k]: the pieces of activation ``a[k]``.
        refs: references to each piece (our own and the graphs'); plain[k]: ``a[k]`` held by us.
        graph[k]: the graph of stage ``k`` is held; released[k]: built by ``Fr k``.
        graph_pieces[k]: the pieces of its input and output the graph of ``k`` holds.
        copies[k]: buffer copies the graph of ``k`` holds; snapshot_bytes[k]: the buffer
            snapshot of stage ``k``, held now.
        ran[k]: stage ``k`` has run forward; in_backward / next_backward: the backward phase.
        writing_bytes: a page-out of the previous operation still being written.
    """

    index: int
    held_bytes: int
    sizes: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...]
    refs: tuple[int, ...]
    plain: tuple[bool, ...]
    graph: tuple[bool, ...]
    released: tuple[bool, ...]
    graph_pieces: tuple[tuple[int, ...], ...]
    copies: tuple[int, ...]
    snapshot_bytes: tuple[int, ...]
    ran: tuple[bool, ...]
    in_backward: bool
    next_backward: int
    writing_bytes: int


def replay_state(chain: Chain, schedule: Schedule, index: int, *, grads_exist: bool) -> ReplayState:
    """What :func:`simulate`'s replay holds just before operation ``index`` runs."""
    found: list[ReplayState] = []
    _replay(chain, schedule, None, grads_exist, (index, found))
    if not found:
        raise InvalidSchedule(f"operation {index} is not in a schedule of {len(schedule)}")
    return found[0]


def _replay(
    chain: Chain,
    schedule: Schedule,
    trace: list[tuple[int, int, int]] | None,
    grads_exist: bool,
    probe: tuple[int, list[ReplayState]] | None = None,
) -> Cost:
    n = chain.length
    if schedule.length != n:
        raise InvalidSchedule(
            f"schedule is for a chain of {schedule.length} stages, this chain has {n}; re-plan it"
        )
    stages = chain.stages
    grad = [chain.gradient_of_activation_bytes(k) for k in range(n + 1)]
    # An activation is one tensor or several (a cut inside a residual block carries the trunk
    # and the skip); each tensor's storage is a *piece*, and a tensor passed through a stage
    # unchanged is the same piece in its input and its output. Piece 0: the input, which the
    # caller holds (never counted).
    sizes = [0]
    pieces: list[list[int]] = [[0]]
    for stage in stages:
        previous = pieces[-1]
        carried = dict(stage.carried)
        shared = dict(stage.shared_leaves)
        own: list[int] = []
        for leaf in range(stage.output_leaves):
            if leaf in carried:
                j = carried[leaf]
                own.append(previous[j] if j < len(previous) else 0)
            elif shared.get(leaf, leaf) < leaf:
                own.append(own[shared[leaf]])  # a view of an earlier tensor of this output
            else:
                sizes.append(stage.leaf_bytes[leaf] if stage.leaf_bytes else stage.output_bytes)
                own.append(len(sizes) - 1)
        pieces.append(own)
    saved_in = [_held(st.saved_inputs, st.saves_input, pieces[k]) for k, st in enumerate(stages)]
    saved_out = [
        _held(st.saved_outputs, st.saves_output, pieces[k + 1]) for k, st in enumerate(stages)
    ]
    refs = [0] * len(sizes)
    plain = [False] * (n + 1)
    graph = [False] * n
    released = [False] * n  # the graph of stage k was built by Fr k: it holds none of a[k]
    ran = [False] * n  # the stage has run forward before: a run again works on buffer copies
    copies = [0] * n  # buffer copies the graph of a stage run again holds
    # A stage whose result depends on buffers its forward changes, run more than once, keeps
    # a snapshot of its buffers from its first run to its last (Stage.reads_updated_buffers).
    kinds, indices = schedule.kinds.tolist(), schedule.indices.tolist()
    last_run: dict[int, int] = {}
    runs = [0] * n
    for i, (code, k) in enumerate(zip(kinds, indices, strict=True)):
        if Op(code).is_forward and 0 <= k < n:
            last_run[k] = i
            runs[k] += 1
    snapshot = [
        stage.recompute_buffer_bytes if stage.reads_updated_buffers and runs[k] > 1 else 0
        for k, stage in enumerate(stages)
    ]
    plain[0] = True
    held = 0
    next_backward = n - 1  # the backward phase goes n-1 .. 0
    in_backward = False
    peak = 0
    peak_op = -1
    checkpoints = 0
    max_checkpoints = 0
    seconds = 0.0
    forward_steps = 0
    forward_all = 0
    paged = [False] * (n + 1)  # a[k] is in a page file
    writing = 0  # bytes a page-out still holds until the operation after it ends
    pages_out = pages_in = paged_bytes = 0

    def fail(i: int, kind: Op, k: int, why: str) -> InvalidSchedule:
        return InvalidSchedule(f"operation {i} ({kind.code}{k}) {why}")

    def take(ids: list[int]) -> int:
        """Refer to these pieces; returns the bytes that became held."""
        added = 0
        for piece in ids:
            refs[piece] += 1
            added += sizes[piece] if refs[piece] == 1 else 0
        return added

    def drop(ids: list[int]) -> int:
        """Stop referring to these pieces; returns the bytes freed."""
        freed = 0
        for piece in ids:
            refs[piece] -= 1
            freed += sizes[piece] if refs[piece] == 0 else 0
        return freed

    def release(k: int) -> int:
        """Drop our reference to a[k] (the input and the caller's output are never dropped)."""
        nonlocal checkpoints
        if k == 0 or k == n or not plain[k]:
            return 0
        plain[k] = False
        checkpoints -= 1
        return drop(pieces[k])

    for i, (code, k) in enumerate(zip(kinds, indices, strict=True)):
        kind = Op(code)
        if probe is not None and probe[0] == i:
            probe[1].append(
                ReplayState(
                    i,
                    held,
                    tuple(sizes),
                    tuple(tuple(p) for p in pieces),
                    tuple(refs),
                    tuple(plain),
                    tuple(graph),
                    tuple(released),
                    tuple(
                        tuple(_kept_by_release(saved_out[j], pieces[j]))
                        if released[j]
                        else tuple(saved_in[j] + saved_out[j])
                        for j in range(n)
                    ),
                    tuple(copies),
                    tuple(snapshot[j] if ran[j] and last_run[j] >= i else 0 for j in range(n)),
                    tuple(ran),
                    in_backward,
                    next_backward,
                    writing,
                )
            )
        before = held
        written, writing = writing, 0
        if kind is Op.PAGE_OUT:
            if not 0 < k < n or not plain[k]:
                raise fail(i, kind, k, "pages out an activation that is not held")
            if any(refs[piece] != 1 for piece in pieces[k]):
                raise fail(i, kind, k, f"pages out a[{k}], which a graph still holds")
            paged[k] = True
            writing = release(k)  # still held, by the writer, until the next operation ends
            pages_out += 1
            paged_bytes += sum(sizes[piece] for piece in pieces[k])
            during = before
        elif kind is Op.PAGE_IN:
            if not paged[k] or plain[k] or any(refs[piece] for piece in pieces[k]):
                raise fail(i, kind, k, f"pages in a[{k}], which is not (only) in a page file")
            paged[k] = False
            plain[k] = True
            checkpoints += 1
            held += take(pieces[k])
            pages_in += 1
            during = held
        elif kind is Op.DISCARD:
            if not 0 < k < n or not plain[k]:
                raise fail(i, kind, k, "discards an activation that is not held")
            held -= release(k)
            during = before
        elif kind is Op.BACKWARD:
            if k != next_backward:
                raise fail(
                    i, kind, k, f"is out of order: the next backward must be B{next_backward}"
                )
            if not graph[k]:
                raise fail(i, kind, k, f"needs the graph of stage {k}, which is not in memory")
            if released[k] and not plain[k]:
                raise fail(i, kind, k, f"needs a[{k}] again (Fr{k} released it), which is not held")
            stage = stages[k]
            if not in_backward:
                # The loss: the caller holds the output and hands us its gradient.
                in_backward = True
                held += grad[n]
                before = held
            during = held + stage.backward_peak(grads_exist)
            graph[k] = False
            # The output's gradient is autograd's to free, after the whole backward.
            held -= stage.saved_bytes + (grad[k + 1] if k + 1 < n else 0) + copies[k]
            copies[k] = 0
            if released[k]:
                held -= drop(_kept_by_release(saved_out[k], pieces[k])) + release(k)
                released[k] = False
            else:
                held -= drop(saved_in[k]) + drop(saved_out[k])
            held += grad[k] + stage.made_gradient_bytes(grads_exist)
            next_backward -= 1
            seconds += stage.backward_seconds
        else:
            if not 0 <= k < n:
                raise fail(i, kind, k, f"names a stage outside 0..{n - 1}")
            if not plain[k]:
                raise fail(i, kind, k, f"needs a[{k}], which is not held")
            if in_backward and k > next_backward:
                raise fail(i, kind, k, "recomputes a stage whose backward is already done")
            if plain[k + 1] or graph[k] or _holds(graph, released, saved_in, k + 1):
                # A second copy of a[k+1] (or of its graph): discard the first one before.
                raise fail(i, kind, k, f"recomputes a[{k + 1}], which is already in memory")
            stage = stages[k]
            seconds += stage.forward_seconds
            plain[k + 1] = True
            checkpoints += k + 1 < n
            # Run again, a stage works on copies of its buffers (BatchNorm's running statistics:
            # the recomputation must not update the model's), which its graph may keep; of all
            # of them, those of a BatchNorm an earlier stage ran too included.
            again = stage.recompute_buffer_bytes if ran[k] else 0
            # What the stage keeps past its run is in its forward peaks, and held from its first
            # run on (a run again makes it anew, then drops the last one).
            kept = 0 if ran[k] else stage.retained_bytes
            held += 0 if ran[k] else snapshot[k]  # taken before the first run
            ran[k] = True
            if kind.builds_graph:
                during = held + again + stage.forward_grad_peak_bytes
                graph[k] = True
                copies[k] = again
                held += take(pieces[k + 1]) + stage.saved_bytes + again
                if kind is Op.FORWARD_RELEASE:
                    # Whatever the graph saved of a[k] is not held (its outputs passed through
                    # from the input are a[k]'s storages too).
                    released[k] = True
                    held += take(_kept_by_release(saved_out[k], pieces[k]))
                else:
                    held += take(saved_out[k]) + take(saved_in[k])
                held -= release(k)
                forward_all += 1
            else:
                during = held + again + stage.forward_peak_bytes
                held += take(pieces[k + 1])
                if kind is Op.FORWARD_NOSAVE:
                    held -= release(k)
                forward_steps += 1
        if kind.is_forward:
            held += kept
        during = max(during, held)
        if kind.is_forward and last_run[k] == i:
            held -= snapshot[k]  # the last run has made its copies of it
        max_checkpoints = max(max_checkpoints, checkpoints)
        if during > peak:
            peak, peak_op = during, i
        held -= written
        if trace is not None:
            trace.append((before, during, held))
    if next_backward != -1:
        raise InvalidSchedule(
            f"schedule ends before the backward of stage {next_backward}; every stage needs a B"
        )
    plain_time = chain.forward_seconds + chain.backward_seconds
    return Cost(
        peak_bytes=peak,
        seconds=seconds,
        recompute_factor=seconds / plain_time if plain_time > 0 else float("nan"),
        forward_steps=forward_steps,
        forward_all_steps=forward_all,
        max_checkpoints=max_checkpoints,
        peak_op=peak_op,
        pages_out=pages_out,
        pages_in=pages_in,
        paged_bytes=paged_bytes,
    )


def _held(which: tuple[int, ...] | None, whole: bool, ids: list[int]) -> list[int]:
    """The pieces of an activation a graph holds: the listed tensors, or all or none."""
    if which is None:
        return list(ids) if whole else []
    return [ids[j] for j in which if j < len(ids)]


def _holds(graph: list[bool], released: list[bool], saved_in: list[list[int]], k: int) -> bool:
    """Whether the graph of stage ``k`` holds part of ``a[k]`` (its input), so that computing
    ``a[k]`` again would make a second copy (a graph built by ``Fr k`` holds none of it)."""
    return k < len(graph) and graph[k] and not released[k] and bool(saved_in[k])


def _kept_by_release(saved_out: list[int], inputs: list[int]) -> list[int]:
    """The pieces of its output a graph built by ``Fr`` holds: those it saved that are not
    pieces of its input (a tensor passed through unchanged is released with the input)."""
    return [piece for piece in saved_out if piece not in inputs]


def made_for(schedule: Schedule, chain: Chain) -> Schedule:
    """``schedule`` with a record of what it was made for (the chain's fingerprint, its name and
    input size), which :class:`~edgetrain.runtime.checkpointed.Checkpointed` checks before running
    it."""
    record = {
        "chain": chain.fingerprint(),
        "model": chain.name,
        "input_bytes": chain.input_bytes,
        "weight_bytes": chain.weight_bytes,
        "stages": chain.length,
    }
    params = {**schedule.params, "made_for": record}
    return Schedule(schedule.length, schedule.kinds, schedule.indices, schedule.strategy, params)
