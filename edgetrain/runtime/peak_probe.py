"""Measure a training step at its predicted peak, by category, beside the prediction.

:class:`PeakProbe` rides on a :class:`~edgetrain.autograd.storage_counter.StorageCounter` through
one step of
:class:`~edgetrain.runtime.checkpointed.Checkpointed`: just before the operation at the plan's
predicted peak
it takes the bytes the step holds (the counter's live bytes) and, of them, the executor's own
references by category (checkpoints, the output, activation and parameter gradients); what is
left is what the stages' graphs hold (and anything else the step made: the caller's loss). The
operation's own peak above that is the running stage's. The fixed part (weights, buffers, input,
gradients kept from the last step) is measured from the tensors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from edgetrain.autograd.storage_counter import StorageCounter, storage_key


def distinct_bytes(
    values: Any, seen: set[int] | None = None, counted: dict[int, int] | None = None
) -> int:
    """Bytes of the distinct tensor storages in ``values`` (any nesting), not in ``seen``; with
    ``counted``, only those storages (a counter's: those the step made)."""
    seen = set() if seen is None else seen
    total = 0
    for leaf in tree_flatten(values)[0]:
        if isinstance(leaf, torch.Tensor):
            key = storage_key(leaf)
            if key not in seen and (counted is None or key in counted):
                seen.add(key)
                total += int(leaf.untyped_storage().nbytes())
    return total


@dataclass
class PeakProbe:
    """One measured step: set ``position`` (the operation of the executed plan to look at).

    Attributes:
        counter: the storage counter the step runs under.
        position: index of the operation in the executed plan (forward then backward phase).
        fixed: measured bytes held before the step, by category.
        parts: measured bytes at ``position`` by category (the step's, above its start).
        step_peak_bytes: the counter's peak over the step (set when the measurement ends).
        heap_peak_bytes: the process heap's peak over the step above its start (glibc's
            ``mallinfo2``: tensors and the scratch kernels allocate; None without glibc).
    """

    counter: StorageCounter
    position: int
    key: tuple[Any, ...] = ()
    grads_exist: bool | None = None
    fixed: dict[str, int] = field(default_factory=dict)
    parts: dict[str, int] = field(default_factory=dict)
    step_peak_bytes: int | None = None
    heap_peak_bytes: int | None = None
    output_keys: tuple[int, ...] = ()
    output_grad_keys: tuple[int, ...] = ()
    _peak_so_far: int = 0

    def measure_fixed(
        self, params: list[torch.Tensor], buffers: list[torch.Tensor], x: Any
    ) -> None:
        """The fixed part, at the step's start: weights, buffers, input, kept gradients."""
        grads = [p.grad for p in params if p.grad is not None]
        self.fixed = {
            "weights": distinct_bytes(params),
            "buffers": distinct_bytes(buffers),
            "input": distinct_bytes(x),
            "gradients": distinct_bytes(grads),
        }

    def before(self, held: dict[str, Any]) -> None:
        """Just before the operation: what the step holds, by the executor's references."""
        live = self.counter.live_bytes
        seen: set[int] = set()
        counted = self.counter._sizes
        parts = {name: distinct_bytes(value, seen, counted) for name, value in held.items()}
        # The output the caller holds (through the backward) by its storages, while alive.
        caller = sum(counted.get(key, 0) for key in set(self.output_keys) - seen)
        parts["output"] = parts.get("output", 0) + caller
        seen |= set(self.output_keys)
        # The output's gradient, which autograd holds until the backward ends.
        handed = sum(counted.get(key, 0) for key in set(self.output_grad_keys) - seen)
        parts["activation gradients"] = parts.get("activation gradients", 0) + handed
        parts["kept graph"] = live - sum(parts.values())
        self.parts = parts
        self._peak_so_far = self.counter.peak_bytes
        self.counter.peak_bytes = live

    def after(self) -> None:
        """Just after the operation: its own peak above what was held before it."""
        live_before = sum(self.parts.values())
        self.parts["running"] = self.counter.peak_bytes - live_before
        self.counter.peak_bytes = max(self.counter.peak_bytes, self._peak_so_far)
