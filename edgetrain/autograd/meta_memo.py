"""Operators on meta tensors, each shape worked out once: :class:`MetaMemo`.

Sizing a model on meta tensors runs every operator's meta kernel, and many of those are Python
(torch's reference implementations: an elementwise operator's broadcasting and type promotion,
``batch_norm``'s decomposition), a few hundred microseconds each. Sizing runs each stage several
times (its forward, its forward with grad, its backward in both training loops), and a network
repeats its blocks: most calls repeat one already made, with inputs of the same shapes, strides
and dtypes and the same other arguments.

:class:`MetaMemo` (a ``TorchDispatchMode``) runs an operator's meta kernel the first time it sees
such a call, and for a call that repeats it makes outputs of the same shapes, strides and dtypes
with ``torch.empty_strided``: new storages of the same sizes, as the kernel makes. It remembers
only what it checked it can stamp out so: outputs that are new storages (not a view of an input
or of each other, not an input changed in place, at offset 0, of the size ``empty_strided``
gives); every other call (views, in-place operators, ``_unsafe_view``) runs its kernel each time.
Byte counts (:class:`~edgetrain.autograd.storage_counter.StorageCounter` below it in the mode
stack sees the same storages) are therefore those of the kernels themselves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgetrain.autograd.storage_counter import storage_key, tensors_in

_MAX_ENTRIES = 200_000
"""Calls remembered at most (then forgotten all at once: a memo, not a store)."""

_NOT_STAMPED = object()
_known: dict[tuple[Any, ...], Any] = {}


def _describe(value: Any) -> Any:
    """What of an argument an operator's output shapes may depend on."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape), value.stride(), value.storage_offset())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_describe(v) for v in value))
    try:
        hash(value)
    except TypeError:
        return (type(value).__name__, repr(value))
    return (type(value).__name__, value)


def call_key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a kind of operator call: the operator, and of its arguments what its
    outputs' shapes may depend on (tensors' shapes, strides, dtypes and offsets, the others'
    values)."""
    return (func, _describe(args), _describe(tuple(sorted(kwargs.items()))))


def _strided_bytes(t: torch.Tensor) -> int:
    """The storage bytes ``torch.empty_strided(t.shape, t.stride())`` allocates."""
    if t.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return extent * t.element_size()


def _stamp(out: Any, inputs: list[torch.Tensor]) -> Any:
    """How to make ``out`` again (whether it is one tensor, and each tensor's shape, stride and
    dtype, None for an output that is None), or :data:`_NOT_STAMPED` when a new
    ``empty_strided`` would not stand for it (see the module)."""
    single = isinstance(out, torch.Tensor)
    if not single and not isinstance(out, tuple):
        return _NOT_STAMPED
    flat = [out] if single else list(out)
    taken = {storage_key(t) for t in inputs}
    leaves: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None] = []
    for t in flat:
        if t is None:
            leaves.append(None)
            continue
        if (
            type(t) is not torch.Tensor
            or t.device.type != "meta"
            or t.layout != torch.strided
            or t.storage_offset() != 0
            or storage_key(t) in taken
            or int(t.untyped_storage().nbytes()) != _strided_bytes(t)
        ):
            return _NOT_STAMPED
        taken.add(storage_key(t))
        leaves.append((tuple(t.shape), t.stride(), t.dtype))
    return single, leaves


class MetaMemo(TorchDispatchMode):
    """Runs each operator's meta kernel once per kind of call (see the module). Calls with a
    tensor not on the meta device pass through untouched."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        tensors = tensors_in((args, kwargs))
        if not tensors or any(t.device.type != "meta" for t in tensors):
            return func(*args, **kwargs)
        key = call_key(func, args, kwargs)
        known = _known.get(key)
        if known is _NOT_STAMPED:
            return func(*args, **kwargs)
        if known is None:
            out = func(*args, **kwargs)
            if len(_known) >= _MAX_ENTRIES:
                _known.clear()
            _known[key] = _stamp(out, tensors)
            return out
        single, leaves = known
        made = tuple(
            None if leaf is None else torch.empty_strided(*leaf[:2], dtype=leaf[2], device="meta")
            for leaf in leaves
        )
        return made[0] if single else made


def forget() -> None:
    """Forget every call remembered (the next of each kind runs its meta kernel again)."""
    _known.clear()
