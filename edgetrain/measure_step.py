"""Measure the memory of one real training step (forward, backward) of a registered model.

What is measured: the bytes of every tensor storage alive at the step's peak — weights, gradients,
optimizer state and buffers (summed before the step) plus the most that the forward and backward
hold at once above them (:class:`~edgetrain.measure.StorageCounter`). The optimizer state is
created by one real optimizer step first, so it is there as in any step after the first.
"""

from __future__ import annotations

import torch

from edgetrain.measure import StorageCounter
from edgetrain.models import build


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[int(storage._cdata)] = int(storage.nbytes())
    return sum(seen.values())


def measure_training_step(name: str, batch: int, image: int, optimizer: str = "adam") -> int:
    """Peak bytes of a real training step of model ``name`` (see the module docstring)."""
    torch.manual_seed(0)
    model = build(name)
    x = torch.randn(batch, 3, image, image)
    params = list(model.parameters())
    opt: torch.optim.Optimizer | None = None
    if optimizer == "adam":
        opt = torch.optim.Adam(params, lr=1e-3)
    elif optimizer == "momentum":
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    # One step creates gradients and optimizer state, as held in every later step.
    model(x).sum().backward()
    if opt is not None:
        opt.step()
    held: list[torch.Tensor] = [*params, *model.buffers(), x]
    held += [p.grad for p in params if p.grad is not None]
    if opt is not None:
        held += [
            v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)
        ]
    before = _storage_bytes(held)
    counter = StorageCounter()
    with counter:
        out = model(x)
        out.sum().backward()
        del out
    return before + counter.peak_bytes
