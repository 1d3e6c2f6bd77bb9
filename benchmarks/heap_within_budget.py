"""The whole step's heap at the smallest budget, against the budget: with the kernels' scratch
counted (as profiled) and, for comparison, without it (the same chain, scratch set to 0).

For each model: ``Checkpointed(model, x, memory_budget=...)`` at the smallest budget that plans
(the frontier's first point), three training steps in PyTorch's default loop (gradients set to
None), and of the last two the most the step took above its start, measured twice: torch's CPU
allocator's running total from the profiler's record (``profile_memory=True``,
:func:`edgetrain.autograd.scratch.allocator_peak`) and glibc's heap (``mallinfo2`` sampled by a
thread, :class:`edgetrain.autograd.heap.HeapPeak`, a lower bound). The step's tensors
(``StorageCounter``) are checked against the prediction too.

Usage: ``python benchmarks/heap_within_budget.py [--models mobilenet_style,mobilenet_v3_small,...]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from edgetrain.autograd.heap import HeapPeak
from edgetrain.autograd.scratch import allocator_peak
from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.core.accounting import fixed_training_bytes
from edgetrain.core.chain import Chain
from edgetrain.models import thirdparty
from edgetrain.runtime.checkpointed import Checkpointed
from edgetrain.runtime.frontier import frontier


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion, 3x3 depthwise, 1x1 projection, BatchNorm and SiLU,
    the input added back."""

    def __init__(self, channels: int, expand: int = 6) -> None:
        super().__init__()
        wide = channels * expand
        self.body = nn.Sequential(
            nn.Conv2d(channels, wide, 1, bias=False),
            nn.BatchNorm2d(wide),
            nn.SiLU(),
            nn.Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False),
            nn.BatchNorm2d(wide),
            nn.SiLU(),
            nn.Conv2d(wide, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def mobilenet_style() -> tuple[nn.Module, torch.Tensor]:
    """Six inverted residual blocks of 16 channels (96 expanded), batch 8, 96x96."""
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *(InvertedResidual(16) for _ in range(6)))
    return model, torch.randn(8, 3, 96, 96)


def mobilenet_flat() -> tuple[nn.Module, torch.Tensor]:
    """Six blocks of the same layers without the skip, 8 channels (48 expanded), each layer a
    stage of its own: the small stage peaks where scratch shows."""
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(6):
        layers += [*InvertedResidual(8).body, nn.SiLU()]
    return nn.Sequential(*layers), torch.randn(8, 3, 96, 96)


def depthwise_7x7() -> tuple[nn.Module, torch.Tensor]:
    """Two 7x7 depthwise convolutions of 32 channels between 1x1 ones, batch 2, 64x64."""
    model = nn.Sequential(
        nn.Conv2d(8, 32, 1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 7, padding=3, groups=32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 7, padding=3, groups=32),
        nn.ReLU(),
        nn.Conv2d(32, 8, 1),
    )
    return model, torch.randn(2, 8, 64, 64)


def conv_7x7() -> tuple[nn.Module, torch.Tensor]:
    """Three 7x7 convolutions of 16 channels, batch 2, 64x64."""
    model = nn.Sequential(
        nn.Conv2d(3, 16, 7, padding=3),
        nn.ReLU(),
        nn.Conv2d(16, 16, 7, padding=3),
        nn.ReLU(),
        nn.Conv2d(16, 16, 7, padding=3),
    )
    return model, torch.randn(2, 3, 64, 64)


class SelfAttention(nn.Module):
    """``F.scaled_dot_product_attention`` of ``x`` with itself, ``heads`` heads."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = x.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(q, q, q)
        return out.transpose(1, 2).reshape(b, t, d)


def attention() -> tuple[nn.Module, torch.Tensor]:
    """Two attention layers of 4 heads between linear ones, 512 tokens of 64, batch 2."""
    model = nn.Sequential(
        nn.Linear(64, 64), SelfAttention(4), nn.Linear(64, 64), SelfAttention(4), nn.Linear(64, 64)
    )
    return model, torch.randn(2, 512, 64)


def _torchvision(name: str) -> Callable[[], tuple[nn.Module, torch.Tensor]]:
    def build() -> tuple[nn.Module, torch.Tensor]:
        return getattr(thirdparty.torchvision().models, name)(), torch.randn(4, 3, 96, 96)

    return build


def _timm(name: str) -> Callable[[], tuple[nn.Module, torch.Tensor]]:
    def build() -> tuple[nn.Module, torch.Tensor]:
        return thirdparty.timm().create_model(name, pretrained=False), torch.randn(4, 3, 96, 96)

    return build


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "mobilenet_style": mobilenet_style,
    "mobilenet_flat": mobilenet_flat,
    "depthwise_7x7": depthwise_7x7,
    "conv_7x7": conv_7x7,
    "attention": attention,
    "mobilenet_v3_small": _torchvision("mobilenet_v3_small"),
    "resnet18": _torchvision("resnet18"),
    "convnext_atto": _timm("convnext_atto"),
    "efficientnet_b0": _timm("efficientnet_b0"),
}


def without_scratch(chain: Chain) -> Chain:
    """``chain`` with no stage's scratch: what a plan counts when it counts tensors only."""
    stages = tuple(
        dataclasses.replace(s, forward_scratch_bytes=0, backward_scratch_bytes=0)
        for s in chain.stages
    )
    return dataclasses.replace(chain, stages=stages)


def _step(net: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    out = net(x)
    out.float().square().mean().backward()
    del out


def measure(model: nn.Module, x: torch.Tensor, chain: Chain) -> dict[str, Any]:
    """The smallest budget on ``chain`` and what a step planned there takes (bytes)."""
    model.zero_grad(set_to_none=True)  # PyTorch's default loop, planned for from the start
    # What a step starts with in PyTorch's default loop (no gradients): Checkpointed.fixed_bytes.
    fixed = fixed_training_bytes(chain) - chain.gradient_bytes
    smallest = frontier(chain, grads_exist=False, fixed_bytes=fixed)[0].budget_bytes
    net = Checkpointed(model, x, chain=chain, memory_budget=smallest)
    allocator, heap, tensors = [], [], []
    for run in range(3):  # the first step warms the kernels' caches up
        if run:
            peak, _ = allocator_peak(lambda: _step(net, model, x))
            allocator.append(peak or 0)
        with HeapPeak() as sampled, StorageCounter() as counter:
            _step(net, model, x)
        if run:
            heap.append(sampled.peak_bytes or 0)
            tensors.append(counter.peak_bytes)
    return {
        "fixed_bytes": net.fixed_bytes,
        "budget_bytes": smallest,
        "step_budget_bytes": smallest - fixed,
        "predicted_tensor_bytes": net.cost.peak_bytes,
        "planned_heap_bytes": net.cost.heap_peak_bytes,
        "measured_tensor_bytes": max(tensors),
        "allocator_peak_bytes": max(allocator),
        "mallinfo2_peak_bytes": max(heap),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name in args.models.split(","):
        model, x = MODELS[name]()
        chain = Checkpointed(model, x).chain
        for counted, on in (("scratch counted", chain), ("tensors only", without_scratch(chain))):
            row = {"model": name, "plan": counted, **measure(model, x, on)}
            heap = max(row["allocator_peak_bytes"], row["mallinfo2_peak_bytes"])
            row["heap_over_step_budget"] = heap / row["step_budget_bytes"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
