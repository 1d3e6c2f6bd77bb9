"""Recomputation inside a rank's step, exact and silent towards the other ranks (torch).

A unit that a rank recomputes (:mod:`edgetrain.tiles.rankplan`) runs under
``torch.utils.checkpoint`` (non-reentrant): its forward keeps only its inputs, and the backward
runs its forward again before going through it. Two things make the second forward the first
one's exact twin without the other ranks knowing of it:

* **Global batch-norm statistics are replayed, not gathered again.** The first forward records
  every statistics gather it makes (:func:`gathered_statistics`, a few hundred bytes per layer)
  on the unit's tape; the second reads them back in the same order. No collective is issued
  during a recomputation, so ranks with different plans (a corner tile recomputing more than a
  middle one) still issue the same collectives in the same order, and the recomputed
  normalisation uses bit-identical statistics.
* **Running statistics are updated once per step.** A recomputation keeps the running mean,
  variance and count of every batch norm of the model as they were before it (they are put
  back after it), so neither :func:`global_batch_norm` nor ``nn.BatchNorm2d`` (a replicated
  tail's) counts the step twice; the recomputed operations are the same calls as the first
  ones, saving the same tensors.

Random draws (dropout in the tail) repeat: checkpoint restores the generator's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from edgetrain.tiles.comm import Comm


class _Tape:
    """The statistics gathers of one unit's first forward, read back by its recomputation."""

    def __init__(self) -> None:
        self.parts: list[list[torch.Tensor]] = []
        self.replaying = False
        self.next = 0


_TAPE: ContextVar[_Tape | None] = ContextVar("edgetrain_tiles_tape", default=None)


def gathered_statistics(comm: Comm, packed: torch.Tensor) -> list[torch.Tensor]:
    """``comm.gather_small(packed)``, recorded during a unit's first forward and replayed from
    that record during its recomputation."""
    tape = _TAPE.get()
    if tape is None:
        return comm.gather_small(packed)
    if tape.replaying:
        parts = tape.parts[tape.next]
        tape.next += 1
        return parts
    parts = comm.gather_small(packed)
    tape.parts.append(parts)
    return parts


@contextlib.contextmanager
def _recording(tape: _Tape) -> Iterator[None]:
    token = _TAPE.set(tape)
    try:
        yield
    finally:
        _TAPE.reset(token)


@contextlib.contextmanager
def _replaying(tape: _Tape, norms: Sequence[nn.modules.batchnorm._BatchNorm]) -> Iterator[None]:
    tape.replaying, tape.next = True, 0
    token = _TAPE.set(tape)
    buffers = [b for bn in norms for b in bn.buffers(recurse=False)]
    kept = [b.clone() for b in buffers]
    try:
        yield
    finally:
        # through .data: the restore must not bump the version of a buffer a batch norm saved
        for buffer, value in zip(buffers, kept, strict=True):
            buffer.data.copy_(value)
        _TAPE.reset(token)


def batch_norms(model: nn.Module) -> tuple[nn.modules.batchnorm._BatchNorm, ...]:
    """Every batch norm of ``model`` (a recomputation leaves their running statistics as
    it found them)."""
    return tuple(m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))


def recomputed(
    function: Callable[..., Any],
    *args: Any,
    norms: Sequence[nn.modules.batchnorm._BatchNorm],
) -> Any:
    """``function(*args)`` keeping only its inputs for backward and running it again there,
    with the same statistics and no second update of the running statistics of ``norms``."""
    tape = _Tape()
    return checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=lambda: (_recording(tape), _replaying(tape, norms)),
    )
