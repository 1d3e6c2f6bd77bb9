"""Each rank's peak memory before any board starts, and the grid that fits a per-board budget.

A rank's peak is predicted by running that rank's training step in this process with
:class:`DryComm`, a communicator of the same ranks whose transfers allocate exactly the buffers
the real ones do and move nothing. The step is the worker's own (:func:`run_job`), counted by the
same :class:`~edgetrain.autograd.storage_counter.StorageCounter`, so the prediction counts every
tensor a board holds: the tile's activations saved for backward, the halo and gathered buffers,
the weight gradients and the gathered tail. A board's total adds the weights and buffers it holds
before the step (SGD keeps no optimizer state). The prediction is the measurement of the same
code on the same shapes, so it equals the board's measured tensor peak.

A budget is a board's memory, and kernels take scratch that no tensor holds (a convolution's
workspace): the dry step also notes its operator calls (:class:`~edgetrain.autograd.scratch.
OpScratch`, each kind of call measured once), and the most any of them takes counts on top of the
tensor peak, as ``Checkpointed``'s budget counts it (the tensors live while a call runs are at
most that peak, so the heap the step needs is at most the two together).
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
    (the most tensors its training step holds above them) plus ``scratch_bytes`` (the most
    scratch one of its kernels takes); ``peak_bytes`` is their sum, what its board's memory
    must hold, and ``tensor_peak_bytes`` the first two, what a tensor counter measures."""

    rank: int
    held_bytes: int
    step_peak_bytes: int
    scratch_bytes: int = 0

    @property
    def tensor_peak_bytes(self) -> int:
        return self.held_bytes + self.step_peak_bytes

    @property
    def peak_bytes(self) -> int:
        return self.tensor_peak_bytes + self.scratch_bytes


def predict_rank(job: Any, rank: int) -> RankMemory:
    """``rank``'s predicted memory for ``job`` (a :class:`~edgetrain.tiles.worker.TileJob`),
    its kernels' scratch measured at torch's thread count here (the workers')."""
    from edgetrain.autograd.scratch import OpScratch, measure_scratch, scratch_of
    from edgetrain.tiles.worker import DTYPES, run_job

    dry = replace(
        job,
        steps=1,
        first_step=0,
        collect=False,
        fault=None,
        measure_memory=True,
        sample_heap=False,
    )
    calls = OpScratch()
    with calls:
        result = run_job(dry, DryComm(rank, job.grid.size))
    measure_scratch(calls.pending)
    scratch = scratch_of(calls.forward | calls.backward)
    return RankMemory(rank, held_bytes(job.model, DTYPES[job.dtype]), result.peak_bytes, scratch)


def measured_on_board(held: int, result: Any) -> dict[str, int | None]:
    """What a board holding ``held`` bytes of weights and buffers measured, weights included:
    its tensors (``board_peak_bytes``) and the process heap sampled during a step
    (``board_heap_peak_bytes``; None without glibc), for ``result``, a
    :class:`~edgetrain.tiles.worker.RankResult`."""
    heap = result.heap_peak_bytes
    return {
        "board_peak_bytes": held + result.peak_bytes,
        "board_heap_peak_bytes": None if heap is None else held + heap,
    }


def measured_beside(memory: RankMemory, result: Any) -> dict[str, int | None]:
    """:func:`measured_on_board` beside the prediction ``memory`` of the same rank: the tensors
    (``predicted_board_peak_bytes``, equal to the measured), the most scratch one of its kernels
    takes (``kernel_scratch_bytes``) and their sum, what its budget holds
    (``predicted_board_heap_bytes``)."""
    return {
        **measured_on_board(memory.held_bytes, result),
        "predicted_board_peak_bytes": memory.tensor_peak_bytes,
        "kernel_scratch_bytes": memory.scratch_bytes,
        "predicted_board_heap_bytes": memory.peak_bytes,
    }


def over_budget(row: dict[str, int | None], budget_bytes: int) -> bool:
    """Whether a :func:`measured_beside` row's measured tensors exceed ``budget_bytes`` (the
    exact count; the sampled heap is reported beside it, and holds up to a few hundred KB to a
    couple of MB that no tensor or kernel call accounts for, which is not predicted)."""
    measured = row["board_peak_bytes"]
    return measured is not None and measured > budget_bytes


def predict_ranks(job: Any) -> tuple[RankMemory, ...]:
    """Every rank's predicted memory for ``job`` (a :class:`~edgetrain.tiles.worker.TileJob`)."""
    return tuple(predict_rank(job, rank) for rank in range(job.grid.size))


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
    """The candidate chosen for a budget and every rank's predicted memory; ``recompute_seconds``
    is what the slowest rank's recomputation adds to the candidate's step time."""

    candidate: Candidate
    ranks: tuple[RankMemory, ...]
    recompute_seconds: float = 0.0

    @property
    def peak_bytes(self) -> int:
        return max(m.peak_bytes for m in self.ranks)

    @property
    def seconds(self) -> float:
        """The predicted step time, recomputation included."""
        return self.candidate.seconds + self.recompute_seconds


def fit_budget(
    first: Candidate,
    others: Any,
    budget_bytes: int,
    boards: int,
    format_bytes: Any,
    recompute: Any = None,
) -> Fitted:
    """``first`` if every rank fits ``budget_bytes``; else of ``others()`` (an iterable of
    candidates, made only when needed) and, with ``recompute(stored, budget_bytes, least)``
    (:func:`~edgetrain.tiles.recompute_fit.fit_recomputing` with the units a rank may
    recompute: the fastest candidate with each rank's recomputation planned, or None, and the
    least-memory option), of those too, the fastest whose every rank fits.

    Raises InvalidInput naming the least memory any candidate needs per board when none fits.
    """
    from edgetrain.errors import InvalidInput

    chosen = Fitted(first, predict_ranks(first.job))
    if chosen.peak_bytes <= budget_bytes:
        return chosen
    stored = [chosen, *(Fitted(c, predict_ranks(c.job)) for c in others())]
    fitting = [f for f in stored if f.peak_bytes <= budget_bytes]
    least = min(stored, key=lambda f: f.peak_bytes)
    if recompute is not None:  # only candidates faster than the fastest that fits already
        bound = min((f.seconds for f in fitting), default=float("inf"))
        best, least = recompute([f for f in stored if f.seconds < bound], budget_bytes, least)
        fitting += [best] if best is not None else []
    if fitting:
        return min(fitting, key=lambda f: f.seconds)
    way = " with every rank's recomputation" if recompute is not None else ""
    raise InvalidInput(
        f"no grid of {boards} boards trains in {format_bytes(budget_bytes)} per board: the "
        f"least any needs{way} is {format_bytes(least.peak_bytes)} per board "
        f"({least.candidate.label}; {least.peak_bytes:,} bytes); give --memory "
        f"{least.peak_bytes} or more, or more boards"
    )
