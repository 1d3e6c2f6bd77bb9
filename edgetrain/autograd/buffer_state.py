"""Whether a stage's result depends on buffer state its own forward changes.

A run of a stage again (a recomputation) must compute what its first run computed. It runs on
copies of the stage's buffers (:func:`~edgetrain.autograd.replay.recomputing`), so that the model's
buffers are updated once per step. For BatchNorm that is enough: in training its output is
normalised with the batch's own statistics, and the running statistics it updates are read by
nothing else. ``spectral_norm`` is different: each forward runs a step of power iteration that
updates the vectors ``u`` and ``v`` (buffers) and then divides the weight by ``uᵀWv``. Run again
from the updated vectors, it computes another weight, and the gradients differ. Such a stage
must be run again from its buffers as they were before its first run: a plan that recomputes it
keeps a copy of them (:attr:`~edgetrain.core.chain.Stage.reads_updated_buffers`).

:class:`BufferFlow` finds such stages from one forward, by data flow, so it works on meta
tensors too: every buffer's value is traced through the operators (a dispatch mode) to the
tensors the stage hands on: its outputs and what autograd saves for its backward. An operator's
results carry the buffers its inputs carry, except for the arguments it writes in place:
BatchNorm's kernel updates ``running_mean`` and returns a normalised output that does not carry
it. Values that leave tensors (``float(t)``) are not traced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from edgetrain.autograd.stage_state import stage_buffers
from edgetrain.autograd.storage_counter import storage_key


class BufferFlow(TorchDispatchMode):
    """Traces which buffers of ``module`` flow into each tensor while it is active.

    Use it around one forward of the stage, then ask :meth:`reaches` whether any buffer the
    forward changed (in place, or by assigning the module a new tensor) flows into the given
    tensors (the outputs and what autograd saved), other than as that buffer itself.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._places = stage_buffers(module.modules())
        self._before = [buffer for _, _, buffer in self._places]
        self._buffer_keys = {storage_key(b): i for i, b in enumerate(self._before)}
        # storage key -> indices (into _places) of the buffers whose values it carries.
        self._carries: dict[int, frozenset[int]] = {
            key: frozenset({i}) for key, i in self._buffer_keys.items()
        }
        self._changed: set[int] = set()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        written: set[int] = set()
        for argument, value in _bound(func, args, kwargs):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written.update(storage_key(t) for t in _tensors(value))
        inputs = {storage_key(t) for t in _tensors((args, kwargs))}
        everything = self._union(inputs)
        for key in written:
            self._carries[key] = self._carries.get(key, frozenset()) | everything
            if key in self._buffer_keys:
                self._changed.add(self._buffer_keys[key])
        read = self._union(inputs - written)
        for t in _tensors(out):
            key = storage_key(t)
            if key in written:
                continue
            # A view of an input carries what it carried; a new storage only what was read (a
            # freed storage's key may come back for a new one).
            known = self._carries.get(key, frozenset()) if key in inputs else frozenset()
            self._carries[key] = known | read
        return out

    def _union(self, keys: set[int]) -> frozenset[int]:
        found: frozenset[int] = frozenset()
        for key in keys:
            found |= self._carries.get(key, frozenset())
        return found

    def reaches(self, keys: set[int]) -> bool:
        """Whether a buffer the forward changed flows into one of the tensors whose storages
        are ``keys`` (:func:`~edgetrain.autograd.storage_counter.storage_key`), not counting a
        buffer's own
        storage (BatchNorm's graph saves ``running_mean`` itself)."""
        changed = set(self._changed)
        changed.update(
            i
            for i, (buffers, name, before) in enumerate(self._places)
            if buffers.get(name) is not before  # the module assigned itself a new tensor
        )
        if not changed:
            return False
        return any(
            key not in self._buffer_keys and self._carries.get(key, frozenset()) & changed
            for key in keys
        )


def _bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Any, Any]]:
    """The operator's schema arguments paired with the values passed for them (none for an
    operator without a schema: nothing counts as written in place)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    arguments = schema.arguments
    pairs = list(zip(arguments, args, strict=False))
    by_name = {a.name: a for a in arguments}
    pairs += [(by_name[name], value) for name, value in kwargs.items() if name in by_name]
    return pairs


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
