"""Hugging Face attention masks built by broadcasting, where transformers builds them with
``torch.vmap``, while a model is traced: :func:`broadcasting_masks`.

transformers (``masking_utils``) describes a mask by a Python function of four indices (batch,
head, query, key: ``kv_idx <= q_idx`` for causal attention, ``padding_mask[batch_idx, kv_idx]``
for padding, their conjunction for a padded causal mask) and makes the 4-D mask by applying
``torch.vmap`` four times over index ranges (``_vmap_for_bhqkv``). fx's proxies do not pass
through ``torch.vmap``, so a causal language model given an ``attention_mask`` (a graph input)
cannot be traced with it. The same functions, called once on index tensors shaped
``(B, 1, 1, 1)``, ``(1, H, 1, 1)``, ``(1, 1, Q, 1)`` and ``(1, 1, 1, KV)``, compute the same mask
by broadcasting (comparisons, indexing, ``&``), operations fx records; :func:`broadcast_for_bhqkv`
returns it with the shape, dtype, strides and values the vmap returns (a mask that does not
depend on the batch is expanded over it, as the vmap's is), so the captured step builds the mask
plain transformers builds, bit for bit.

Nothing here imports transformers: :func:`broadcasting_masks` replaces
``transformers.masking_utils._vmap_for_bhqkv`` only when that module is loaded already, and only
for the thread that traces (other threads run transformers' own function meanwhile).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

MASKING_UTILS = "transformers.masking_utils"
_VMAP = "_vmap_for_bhqkv"
_TRACING = threading.local()  # ``on`` in the thread that traces


def broadcast_for_bhqkv(
    mask_function: Callable[..., Any], bh_indices: bool = True
) -> Callable[..., Any]:
    """``mask_function`` of (batch, head, query, key) indices applied to every combination of
    the index ranges it is given, as ``_vmap_for_bhqkv(mask_function, bh_indices)`` applies it:
    a ``(B, H, Q, KV)`` mask, or ``(Q, KV)`` when ``bh_indices`` is False (the batch and head
    indices are then passed as they are)."""

    def mask(batch: Any, head: Any, query: torch.Tensor, key: torch.Tensor) -> Any:
        if bh_indices:
            shape = (len(batch), len(head), len(query), len(key))
            out = mask_function(
                batch.view(-1, 1, 1, 1),
                head.view(1, -1, 1, 1),
                query.view(1, 1, -1, 1),
                key.view(1, 1, 1, -1),
            )
        else:
            shape = (len(query), len(key))
            out = mask_function(batch, head, query.view(-1, 1), key.view(1, -1))
        size = getattr(out, "shape", None)  # a traced value's is its meta tensor's
        return out if isinstance(size, torch.Size) and tuple(size) == shape else out.expand(shape)

    return mask


@contextlib.contextmanager
def broadcasting_masks() -> Iterator[None]:
    """Within it, in this thread, transformers' masks are built by :func:`broadcast_for_bhqkv`
    (when ``transformers.masking_utils`` is loaded; otherwise nothing changes). The caller holds
    the trace lock: the module attribute it replaces is global."""
    masking = sys.modules.get(MASKING_UTILS)
    vmapped = getattr(masking, _VMAP, None)
    if masking is None or vmapped is None:
        yield
        return

    def for_bhqkv(mask_function: Callable[..., Any], bh_indices: bool = True) -> Any:
        if getattr(_TRACING, "on", False):
            return broadcast_for_bhqkv(mask_function, bh_indices)
        return vmapped(mask_function, bh_indices)

    setattr(masking, _VMAP, for_bhqkv)
    _TRACING.on = True
    try:
        yield
    finally:
        _TRACING.on = False
        setattr(masking, _VMAP, vmapped)
