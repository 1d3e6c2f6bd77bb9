"""Exact, repeatable peak memory of tensors: a live-storage counter.

:class:`StorageCounter` is a ``TorchDispatchMode``: every operator call passes through it, and every
storage an operator creates is counted until it is freed (a ``weakref.finalize`` on the storage).
Views and in-place results share their input's storage and are not counted again. Storages that
existed before the counter started are not counted at all, so ``peak_bytes`` is the most memory
held at once *above what was already there*. It sees autograd's backward too and works on meta
tensors, so the same code measures a real run and predicts one from shapes alone. Allocations
inside a kernel that never become a tensor (scratch buffers) are not seen. RSS is not used: it
moves with the allocator's caching and other processes.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or results (tuples, lists and dicts of them):
    what ``tree_flatten`` would find there, without its cost per call."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def storage_key(tensor: torch.Tensor) -> int:
    """An identifier of the tensor's storage (shared by views and in-place results)."""
    return int(tensor.untyped_storage()._cdata)


class StorageCounter(TorchDispatchMode):
    """Counts the bytes of tensor storages created while it is active.

    Attributes:
        live_bytes: bytes of counted storages alive now.
        peak_bytes: most ``live_bytes`` seen since the start or the last :meth:`reset_peak`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> int:
        """Restart peak tracking from the current live bytes; returns them."""
        self.peak_bytes = self.live_bytes
        return self.live_bytes

    def _freed(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tensors_in((args, kwargs))}
        for tensor in tensors_in(out):
            storage = tensor.untyped_storage()
            key = int(storage._cdata)
            if key in inputs or key in self._sizes:
                continue
            size = int(storage.nbytes())
            self._sizes[key] = size
            self.live_bytes += size
            weakref.finalize(storage, self._freed, key)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each shared storage counted once)."""
    sizes = {storage_key(t): int(t.untyped_storage().nbytes()) for t in tensors}
    return sum(sizes.values())


def resident_tensor_bytes() -> int:
    """Bytes of every tensor this process's Python objects hold, each storage once (what the
    garbage collector finds: tensors only C++ holds, such as a running backward's, are not)."""
    found = [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta and _has_storage(obj)
    ]
    return storage_bytes(found)


def _has_storage(tensor: torch.Tensor) -> bool:
    try:
        tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less kinds
        return False
    return True
