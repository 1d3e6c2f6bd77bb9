"""Copies of a model and its sample on ``meta`` tensors (shapes, no data), for sizing a chain
without running a kernel: :func:`meta_copy` shares nothing with the model it copies (a storage
counter's own tensors excepted), :func:`to_meta` turns every tensor of a sample into its meta twin.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from edgetrain.autograd.stages import leaves
from edgetrain.autograd.storage_counter import storage_key


def to_meta(sample_input: Any) -> Any:
    flat, spec = tree_flatten(sample_input)
    return tree_unflatten([_meta_like(t) if isinstance(t, torch.Tensor) else t for t in flat], spec)


def any_meta(sample_input: Any) -> bool:
    return any(t.device.type == "meta" for t in leaves(sample_input))


def meta_copy(model: nn.Module, copies: dict[int, Any] | None = None) -> nn.Module:
    """The model with every parameter and buffer on the meta device, without copying data; a
    tensor shared by several modules (a tied weight) stays one tensor. An integer scalar buffer
    (a counter such as ``num_batches_tracked``) is copied as it is: a forward may read its value
    (``1 / float(self.num_batches_tracked)``), which a meta tensor has not. ``copies``: what
    earlier copies made, by the original's ``id`` (:func:`copy.deepcopy`'s memo, which keeps
    the originals alive): a module or tensor copied before is that copy again, so copies of
    models that share modules (the stages a plan may merge, see
    :func:`~edgetrain.frontend.profiling.merged_chain`) copy each once and keep the ties."""

    def meta_unless_counter(t: torch.Tensor) -> torch.Tensor:
        counter = t.dim() == 0 and not t.is_floating_point() and not t.is_complex()
        return t.detach().clone() if counter else _meta_like(t)

    return copy_on(model, meta_unless_counter, copies)


def copy_on(
    model: nn.Module,
    tensor: Callable[[torch.Tensor], torch.Tensor],
    copies: dict[int, Any] | None = None,
) -> nn.Module:
    """A deep copy of the model whose parameters are new ``nn.Parameter`` s over
    ``tensor(p.detach())`` (none of the originals' hooks) and whose buffers are ``tensor(b)``;
    a tensor shared by several modules (a tied weight) stays one tensor, and so do buffers
    that view one storage alike. ``copies``: the memo
    of earlier copies to reuse and extend (see :func:`meta_copy`)."""
    memo: dict[int, Any] = {} if copies is None else copies
    originals = memo.setdefault(id(memo), [])  # deepcopy's own: its keys' objects stay alive
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(tensor(p.detach()), requires_grad=p.requires_grad)
            originals.append(p)
    # Buffers that are one view of one storage (the constants capture makes of one tensor a
    # model computes once and reads in two layers: GPT-2's attention mask) stay one tensor.
    views: dict[tuple[Any, ...], torch.Tensor] = {}
    for b in model.buffers():
        if id(b) not in memo:
            view = (storage_key(b), b.storage_offset(), b.shape, b.stride(), b.dtype)
            memo[id(b)] = views[view] if view in views else views.setdefault(view, tensor(b))
            originals.append(b)
    # A tensor a module keeps as a plain attribute: the older weight_norm and spectral_norm
    # hooks set the weight they compute, which (not a leaf) deepcopy refuses.
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = tensor(value.detach())
                originals.append(value)
    return copy.deepcopy(model, memo)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return out.requires_grad_(t.requires_grad)


def on_meta(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)
