"""Schedule: one plan type for every planner, and its file format.

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

The simulator that replays a schedule is :mod:`edgetrain.core.simulator`; the runs of stages the
executor may run as one graph are :mod:`edgetrain.core.graph_merge`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

from edgetrain.core.chain import Chain
from edgetrain.errors import CorruptFile
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
