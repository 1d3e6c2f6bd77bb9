"""An operator call noted without its tensors, and made again on the CPU: what the kernels'
scratch (:mod:`edgetrain.autograd.scratch`) and the time of a call (:mod:`edgetrain.frontend.
call_seconds`) are measured on. :func:`specs` replaces each tensor of a call's arguments by its
:class:`Spec` (shape, strides, dtype; no tensor kept alive); :func:`made` makes new CPU tensors
of zeros from them, as noted or in another layout (:data:`LAYOUTS`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

__all__ = ["LAYOUTS", "Spec", "made", "makes_new_outputs", "specs", "strides"]

LAYOUTS = ("as noted", "contiguous", "channels last")
"""The layouts a call is made again in: its tensors' strides as noted, contiguous, or
channels-last (a 4-D or 5-D tensor; others as noted)."""


class Spec:
    """A tensor argument as :func:`made` makes it again: shape, strides, dtype."""

    __slots__ = ("dtype", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype = tuple(t.shape), t.stride(), t.dtype

    def laid_out(self, layout: str) -> tuple[int, ...]:
        """Its strides as noted (``"as noted"``), contiguous, or channels-last (a 4-D or 5-D
        tensor; others as noted)."""
        if layout == "as noted":
            return self.stride
        probe = torch.empty(self.shape, device="meta")
        if layout == "channels last" and probe.dim() in (4, 5):
            last = torch.channels_last if probe.dim() == 4 else torch.channels_last_3d
            return probe.contiguous(memory_format=last).stride()
        return probe.stride()


def specs(value: Any) -> Any:
    """``value`` with each tensor replaced by its :class:`Spec` (no tensor kept alive)."""
    if isinstance(value, torch.Tensor):
        return Spec(value)
    if isinstance(value, (list, tuple)):
        return type(value)(specs(v) for v in value)
    if isinstance(value, dict):
        return {k: specs(v) for k, v in value.items()}
    return value


def strides(value: Any, layout: str) -> tuple[Any, ...]:
    """The strides of the tensors :func:`made` makes of ``value`` in ``layout``."""
    if isinstance(value, Spec):
        return (value.laid_out(layout),)
    if isinstance(value, (list, tuple)):
        return tuple(s for v in value for s in strides(v, layout))
    if isinstance(value, dict):
        return tuple(s for v in value.values() for s in strides(v, layout))
    return ()


def made(value: Any, layout: str) -> Any:
    """``value`` with each :class:`Spec` made a new CPU tensor of its shape and dtype, in
    ``layout`` (see :data:`LAYOUTS`), of zeros: what a dense kernel allocates does not depend
    on the values (and an index of 0 is always in range)."""
    if isinstance(value, Spec):
        stride = value.laid_out(layout)
        extent = 1 + sum((n - 1) * s for n, s in zip(value.shape, stride, strict=True))
        base = torch.zeros(extent if all(value.shape) else 0, dtype=value.dtype)
        return base.as_strided(value.shape, stride)
    if isinstance(value, (list, tuple)):
        return type(value)(made(v, layout) for v in value)
    if isinstance(value, dict):
        return {k: made(v, layout) for k, v in value.items()}
    return value


@cache
def makes_new_outputs(func: Any) -> bool:
    """Whether an operator's call may do more than write what it allocates: not an elementwise
    one (its kernel writes the output it allocates), a view, or one that returns an input (in
    place, ``out=``). The calls whose scratch and whose time are measured."""
    if not isinstance(func, torch._ops.OpOverload):
        return False
    if torch.Tag.pointwise in func.tags or func.is_view:
        return False
    return all(r.alias_info is None for r in func._schema.returns)
