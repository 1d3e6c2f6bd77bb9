"""Summing over the ranks what a training step needs summed: weight gradients in buckets that
overlap the backward pass, and the loss (torch).

Every rank applies the same update to the same weights only if every rank holds the same summed
gradients; these all-reduces are started as early as the data allow and finished together in
one synchronisation point at the end of backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edgetrain.tiles.comm import Comm
from edgetrain.tiles.grouping import gradient_buckets


@dataclass(frozen=True)
class LossTotal:
    """The batch's loss as a step reports it: ``value`` once ``work`` (an all-reduce of the
    ranks' shares, started before backward and finished with the gradients) is done."""

    value: torch.Tensor
    work: Any = None

    @staticmethod
    def summed(share: torch.Tensor, comm: Comm) -> LossTotal:
        total = share.detach().reshape(1).clone()
        return LossTotal(total, comm.all_reduce_start(total))

    def __float__(self) -> float:
        return float(self.value.item())


class GradientSync:
    """Sum every parameter's gradient over the ranks while backward is still running.

    The gradients are summed in buckets (:func:`~edgetrain.tiles.grouping.gradient_buckets` of
    the parameters, the last registered first: consecutive ones up to a MiB, a larger one
    alone), one collective each. A hook on each parameter marks its gradient accumulated; a
    bucket whose gradients are all there starts an asynchronous all-reduce (a bucket of several
    is copied into one buffer and the gradients become views of it, so nothing is held twice),
    so the transfer overlaps with the backward pass of the earlier layers. Buckets start
    strictly in their fixed order, so the collectives match on every rank whatever order
    autograd runs in; :meth:`wait` starts what is left and finishes them all, in one
    synchronisation point.
    """

    def __init__(self, parameters: list[nn.Parameter], comm: Comm) -> None:
        self.comm = comm
        unique = {id(p): p for p in parameters if p.requires_grad}  # a shared one counts once
        self.parameters = list(reversed(unique.values()))
        sizes = [p.numel() * p.element_size() for p in self.parameters]
        self.buckets = [[self.parameters[i] for i in bucket] for bucket in gradient_buckets(sizes)]
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.started = 0
        self.pending: list[Any] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._done) for p in self.parameters]

    def _done(self, parameter: torch.Tensor) -> None:
        self.ready[self.bucket_of[id(parameter)]] += 1
        while self.started < len(self.buckets) and self.ready[self.started] == len(
            self.buckets[self.started]
        ):
            self._start(self.buckets[self.started])
            self.started += 1

    def _start(self, bucket: list[nn.Parameter]) -> None:
        grads = [p for p in bucket if p.grad is not None]
        if not grads or self.comm.size == 1:  # alone, a gradient is its own sum
            return
        if len(grads) == 1:
            flat = grads[0].grad
        else:
            flat = torch.cat([p.grad.reshape(-1) for p in grads])  # type: ignore[union-attr]
            offset = 0
            for p in grads:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        assert flat is not None
        self.add(self.comm.all_reduce_start(flat))

    def add(self, work: Any) -> None:
        """Finish ``work`` (a collective started on every rank) with the gradients."""
        if work is not None:
            self.pending.append(work)

    def wait(self) -> None:
        """Start the buckets not started yet (gradients that never came) after a backward pass,
        then block until every one is summed."""
        if self.started or any(self.ready):
            for bucket in self.buckets[self.started :]:
                self._start(bucket)
        self.ready = [0] * len(self.buckets)
        self.started = 0
        if self.pending:
            self.comm.wait_all(self.pending)
        self.pending.clear()

    def close(self) -> None:
        self.wait()
        self.remove()

    def remove(self) -> None:
        """Take the hooks off the parameters (idempotent)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
