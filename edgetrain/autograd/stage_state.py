"""What a stage's modules hold, found once per plan: its trainable parameters (every place a
module holds one, tied ones included) and its buffers, which a recomputation runs on copies of."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edgetrain.autograd.storage_counter import storage_key


@dataclass(frozen=True)
class StageParams:
    """A stage's trainable parameters, resolved once per plan.

    Attributes:
        params: each distinct parameter once, with its index among the model's parameters.
        slots: every place the stage's modules hold one of them (tied ones included): the
            owning module's parameter dict, the name in it, and the position in ``params``.
    """

    params: tuple[tuple[int, nn.Parameter], ...]
    slots: tuple[tuple[dict[str, Any], str, int], ...]


def stage_params(module: nn.Module, index_of: dict[int, int]) -> StageParams:
    """The trainable parameters of a stage and every place its modules hold them (tied ones
    included), each with its index among the model's parameters (``index_of``: ``id(p)`` ->
    index)."""
    position: dict[int, int] = {}
    params: list[tuple[int, nn.Parameter]] = []
    slots: list[tuple[dict[str, Any], str, int]] = []
    for sub in module.modules():  # a module listed twice holds its parameters in one place
        for pname, p in sub._parameters.items():
            if p is None or not p.requires_grad or id(p) not in index_of:
                continue
            if id(p) not in position:
                position[id(p)] = len(params)
                params.append((index_of[id(p)], p))
            slots.append((sub._parameters, pname, position[id(p)]))
    return StageParams(tuple(params), tuple(slots))


BufferPlace = tuple[dict[str, torch.Tensor | None], str, torch.Tensor]
"""Where a module holds a buffer: its buffer dict, the name in it, and the tensor."""


def stage_buffers(modules: Iterable[nn.Module]) -> list[BufferPlace]:
    """Every buffer the ``modules`` (a stage's ``modules()``) hold, with where: what a
    recomputation of the stage runs on copies of (:mod:`edgetrain.runtime.checkpointed`), a module
    another
    stage runs too (one BatchNorm applied twice) included. A tensor held in two places appears
    twice (it is copied once)."""
    return [
        (sub._buffers, name, buffer)
        for sub in modules
        for name, buffer in sub._buffers.items()
        if buffer is not None
    ]


def buffer_copy_bytes(module: nn.Module, saved: set[int] | None = None) -> int:
    """Bytes of the copies of :func:`stage_buffers` a recomputation of the stage ``module``
    makes: each distinct buffer once, its elements times their size (what ``clone`` holds).
    With ``saved`` (the storage keys of what autograd saved in a forward of the stage), only
    the copies its graph keeps: those of the buffers whose storage it saved (a view of one
    included: it keeps the whole copy)."""
    distinct = {id(t): t for _, _, t in stage_buffers(module.modules())}
    return sum(
        t.numel() * t.element_size()
        for t in distinct.values()
        if saved is None or storage_key(t) in saved
    )
