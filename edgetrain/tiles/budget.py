"""Each rank's peak memory before any board starts, and the grid that fits a per-board budget.

A rank's peak is predicted by running that rank's training step in this process with
:class:`DryComm`, a communicator of the same ranks whose transfers allocate exactly the buffers
the real ones do and move nothing. The step is the worker's own (:func:`run_job`), counted by the
same :class:`~edgetrain.autograd.storage_counter.StorageCounter`, so the prediction counts every
tensor a board holds: the tile's activations saved for backward, the halo and gathered buffers,
the weight gradients and the gathered tail. A board's total adds the weights and buffers it holds
before the step (SGD keeps no optimizer state). The prediction is the measurement of the same
code on the same shapes, so it equals the board's measured peak.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from edgetrain.tiles.comm import Comm
from edgetrain.tiles.grid import Grid


class _Done:
    def wait(self) -> None:
        return None


class DryComm(Comm):
    """Rank ``rank`` of ``size`` with no peers behind it: receives and gathers allocate their
    buffers as the real exchange does (zeros), sends and reductions move nothing."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(None, rank, size)

    def _p2p(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        receives: Sequence[tuple[int, torch.Tensor]],
        tag: int,
    ) -> None:
        for _, tensor in receives:
            tensor.zero_()
        for _, tensor in sends:
            tensor.contiguous()

    def gather_small(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [tensor if r == self.rank else torch.zeros_like(tensor) for r in range(self.size)]
        return parts

    def all_reduce_start(self, tensor: torch.Tensor) -> Any:
        return _Done()


def held_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the weights and buffers a board holds between steps, its floating-point tensors
    in ``dtype`` (None: as they are)."""
    total = 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        size = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
        total += t.numel() * size
    return total


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted memory: ``held_bytes`` (weights, buffers) plus ``step_peak_bytes``
    (the most its training step holds above them); ``peak_bytes`` is their sum."""

    rank: int
    held_bytes: int
    step_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + self.step_peak_bytes


def predict_ranks(job: Any) -> tuple[RankMemory, ...]:
    """Every rank's predicted memory for ``job`` (a :class:`~edgetrain.tiles.worker.TileJob`)."""
    from edgetrain.tiles.worker import DTYPES, run_job

    dry = replace(job, steps=1, first_step=0, collect=False, fault=None, measure_memory=True)
    held = held_bytes(job.model, DTYPES[job.dtype])
    memories = []
    for rank in range(job.grid.size):
        result = run_job(dry, DryComm(rank, job.grid.size))
        memories.append(RankMemory(rank, held, result.peak_bytes))
    return tuple(memories)


def grids_of(boards: int) -> tuple[Grid, ...]:
    """Every ``rows x cols`` grid of exactly ``boards`` tiles, squarest first."""
    shapes = [(r, boards // r) for r in range(1, boards + 1) if boards % r == 0]
    shapes.sort(key=lambda s: (abs(s[0] - s[1]), -s[1]))
    return tuple(Grid(r, c) for r, c in shapes)


@dataclass(frozen=True)
class Candidate:
    """A way to run the model: ``job`` with ``seconds`` the cost model's predicted step time,
    ``label`` how it reads to a user ("grid 2x2, groups 0-3,4-15")."""

    job: Any
    seconds: float
    label: str
    extra: Any = None


@dataclass(frozen=True)
class Fitted:
    """The candidate chosen for a budget and every rank's predicted memory."""

    candidate: Candidate
    ranks: tuple[RankMemory, ...]

    @property
    def peak_bytes(self) -> int:
        return max(m.peak_bytes for m in self.ranks)


def fit_budget(
    first: Candidate, others: Any, budget_bytes: int, boards: int, format_bytes: Any
) -> Fitted:
    """``first`` if every rank fits ``budget_bytes``; else of ``others()`` (an iterable of
    candidates, made only when needed) the fastest whose every rank fits.

    Raises InvalidInput naming the least memory any candidate needs per board when none fits.
    """
    from edgetrain.errors import InvalidInput

    chosen = Fitted(first, predict_ranks(first.job))
    if chosen.peak_bytes <= budget_bytes:
        return chosen
    least = chosen
    fitting: list[Fitted] = []
    for candidate in others():
        fitted = Fitted(candidate, predict_ranks(candidate.job))
        if fitted.peak_bytes <= budget_bytes:
            fitting.append(fitted)
        if fitted.peak_bytes < least.peak_bytes:
            least = fitted
    if fitting:
        return min(fitting, key=lambda f: f.candidate.seconds)
    raise InvalidInput(
        f"no grid of {boards} boards trains in {format_bytes(budget_bytes)} per board: the "
        f"least any needs is {format_bytes(least.peak_bytes)} per board ({least.candidate.label}; "
        f"{least.peak_bytes:,} bytes); give --memory {least.peak_bytes} or more, or more boards"
    )
