"""Measure the memory of one real training step (forward, backward) of a registered model.

What is measured: the bytes of every tensor storage alive at the step's peak — weights, gradients,
optimizer state, buffers and input (held before the step) plus the most that the forward and
backward hold at once above them (:class:`~edgetrain.autograd.storage_counter.StorageCounter`). One
real optimizer
step runs first, so gradients and optimizer state exist as in any step after the first.
"""

from __future__ import annotations

import torch

from edgetrain import StorageCounter
from edgetrain.models import build
from edgetrain.runtime.training import held_before_step, make_optimizer


def measure_training_step(name: str, batch: int, image: int, optimizer: str = "adam") -> int:
    """Peak bytes of a real training step of model ``name`` (see the module docstring)."""
    torch.manual_seed(0)
    model = build(name)
    x = torch.randn(batch, 3, image, image)
    params = list(model.parameters())
    opt = make_optimizer(optimizer, params, lr=1e-3)
    model(x).sum().backward()
    opt.step()
    before = held_before_step(params, model, opt, [x])
    counter = StorageCounter()
    with counter:
        out = model(x)
        out.sum().backward()
        del out
    return before + counter.peak_bytes
