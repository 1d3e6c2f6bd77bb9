"""Exact tensor memory: a dispatch mode that counts live tensor storages (torch).

Every operator's new output storages (not views or in-place results of its inputs) are added
when they first appear and subtracted when the storage is freed (a ``weakref.finalize`` on the
storage). The mode sees autograd's backward operators too, and works on meta tensors, so the
count is deterministic, unlike RSS, which also holds the allocator's caches and the interpreter.
Storages that existed before the mode was entered (the weights) are not counted.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StorageMeter(TorchDispatchMode):
    """Live bytes of tensor storages created inside the ``with`` block, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def _free(self, key: int, size: int) -> None:
        if self._live.pop(key, None) is not None:
            self.live_bytes -= size

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in self._live or key in inputs:  # a view or an in-place result
                    continue
                size = storage.nbytes()
                self._live[key] = size
                self.live_bytes += size
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                weakref.finalize(storage, self._free, key, size)
        return out
