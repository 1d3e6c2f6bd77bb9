"""What many tests do: one training step and the most tensor memory it holds, counted by
:class:`~edgetrain.autograd.storage_counter.StorageCounter` (the executor's contract is stated in
those bytes)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from edgetrain.autograd.storage_counter import StorageCounter


def square_sum(out: torch.Tensor) -> None:
    """The default step's loss and backward: ``out.square().sum().backward()``."""
    out.square().sum().backward()


def set_gradients(params: Iterable[nn.Parameter], kept: bool) -> None:
    """The training loop's ``zero_grad()``: gradients kept and zeroed
    (``set_to_none=False``), or set to None (PyTorch's default)."""
    for p in params:
        p.grad = torch.zeros_like(p) if kept else None


def step_peak(
    net: nn.Module,
    x: Any,
    *,
    backward: Callable[[torch.Tensor], None] = square_sum,
    kept: bool | None = None,
    params: Iterable[nn.Parameter] | None = None,
) -> int:
    """The tensor peak (bytes above what was held before) of one step: ``out = net(x)``, then
    ``backward(out)``, the output referenced until the step ends, as the usual loop holds it.

    ``kept``: before the step, the gradients of ``params`` (default: ``net``'s) are kept and
    zeroed (True) or set to None (False); None leaves them as they are."""
    if kept is not None:
        set_gradients(net.parameters() if params is None else params, kept)
    counter = StorageCounter()
    with counter:
        out = net(x)
        backward(out)
        del out
    return counter.peak_bytes


def same_state(ours: nn.Module, plain: nn.Module) -> None:
    """The two copies of a model hold bitwise-equal gradients (None in both, or equal) and
    buffers after the same steps."""
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(ours.named_buffers(), plain.buffers(), strict=True):
        assert torch.equal(b, c), name
