"""At the smallest budget, the whole step's process heap (glibc ``mallinfo2``) stays within the
budget: the scratch kernels allocate beyond their tensors (a depthwise or 7x7 convolution's
workspace, attention's buffers) is measured when the stages
are profiled and counted by the simulator, so the plan leaves room for it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.autograd.heap import HeapPeak, heap_in_use
from edgetrain.autograd.scratch import allocator_peak
from edgetrain.core.chain import Chain
from edgetrain.runtime.checkpointed import Checkpointed
from edgetrain.runtime.frontier import frontier

pytestmark = pytest.mark.skipif(heap_in_use() is None, reason="needs glibc's mallinfo2")

HEAP_SLACK_BYTES = 128 * 1024
"""What the heap holds in a step beyond tensors and kernel scratch: glibc's chunk headers and
alignment (16 bytes a chunk; torch's CPU allocator aligns each tensor to 64 bytes), the
autograd nodes and executor objects a step makes (60 KiB at most in these models' steps),
bounded by glibc's allocation granularity for the heap (``M_TOP_PAD`` and the first
``M_MMAP_THRESHOLD``: 128 KiB each)."""


class _Attention(nn.Module):
    """Self-attention of ``x`` with itself (no projections), ``heads`` heads."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = x.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q)
        return out.transpose(1, 2).reshape(b, t, d)


def _heap_and_budget(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """The most heap a step at the smallest budget takes above what it starts with (weights,
    buffers, the input), and that budget less what the step starts with. The heap is seen
    twice, in steps of their own: glibc's (``mallinfo2`` sampled by a thread, which sees every
    allocation but may miss a short one) and torch's allocator's record (the profiler's
    allocator events, which miss none of torch's)."""
    torch.manual_seed(0)
    net = Checkpointed(model, x, memory_budget="min")
    smallest = frontier(net.chain, grads_exist=False, fixed_bytes=net.fixed_bytes)[0]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = net(x)
        out.backward(torch.ones_like(out))
        del out

    peaks = []
    for _ in range(3):  # the first step warms the kernels' caches up
        with HeapPeak() as heap:
            step()
        peaks.append(heap.peak_bytes or 0)
    recorded, _ = allocator_peak(step)
    assert recorded is not None
    return max(*peaks[1:], recorded), smallest.budget_bytes - net.fixed_bytes


def _scratch(chain: Chain) -> int:
    return sum(s.forward_scratch_bytes + s.backward_scratch_bytes for s in chain.stages)


def test_a_depthwise_chain_keeps_its_heap_within_the_smallest_budget():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(8, 32, 1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 7, padding=3, groups=32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 7, padding=3, groups=32),
        nn.ReLU(),
        nn.Conv2d(32, 8, 1),
    )
    x = torch.randn(2, 8, 64, 64)
    heap, budget = _heap_and_budget(model, x)
    assert heap <= budget + HEAP_SLACK_BYTES, (heap, budget)


def test_a_large_kernel_chain_keeps_its_heap_within_the_smallest_budget():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 7, padding=3),
        nn.ReLU(),
        nn.Conv2d(16, 16, 7, padding=3),
        nn.ReLU(),
        nn.Conv2d(16, 16, 7, padding=3),
    )
    x = torch.randn(2, 3, 64, 64)
    heap, budget = _heap_and_budget(model, x)
    assert heap <= budget + HEAP_SLACK_BYTES, (heap, budget)


def test_an_attention_chain_keeps_its_heap_within_the_smallest_budget():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64), _Attention(4), nn.Linear(64, 64), _Attention(4), nn.Linear(64, 64)
    )
    x = torch.randn(2, 512, 64)
    heap, budget = _heap_and_budget(model, x)
    assert heap <= budget + HEAP_SLACK_BYTES, (heap, budget)


def test_a_profiled_convolution_carries_its_scratch_and_a_chain_file_keeps_it():
    model = nn.Sequential(nn.Conv2d(16, 16, 7, padding=3), nn.ReLU())
    x = torch.randn(2, 16, 64, 64, requires_grad=True)
    chain = Checkpointed(model, x).chain
    conv = chain.stages[0]
    assert conv.forward_scratch_bytes > HEAP_SLACK_BYTES  # oneDNN's workspace: 561 KiB here
    assert conv.backward_scratch_bytes > HEAP_SLACK_BYTES  # 1 MiB here
    again = Checkpointed(model, x).chain.stages[0]  # the allocator's record: the same bytes
    assert (again.forward_scratch_bytes, again.backward_scratch_bytes) == (
        conv.forward_scratch_bytes,
        conv.backward_scratch_bytes,
    )
    assert Chain.from_json(chain.to_json()) == chain
    old = chain.to_dict()
    for stage in old["stages"]:
        del stage["forward_scratch_bytes"], stage["backward_scratch_bytes"]
    assert _scratch(Chain.from_dict(old)) == 0
