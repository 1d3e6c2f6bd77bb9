"""Kernel scratch is measured once per kind of operator call and bounds what a stage's calls
take beyond its tensors."""

from __future__ import annotations

import torch
from torch import nn

from edgetrain.autograd.scratch import OpScratch, allocator_peak, scratch_of
from edgetrain.frontend.profiling import analytic_chain, profile_chain


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
    )


def test_each_kind_of_operator_call_is_measured_once_and_read_back_by_the_step():
    model, x = _model(), torch.randn(4, 8, 24, 24)
    chain = profile_chain(model, x, timing="modelled")
    # Sized on meta tensors, measured on the CPU: the two convolutions and the two BatchNorms
    # are one kind of call each, and a step on the device runs those kinds again.
    ops = OpScratch()
    with ops:
        out = model(x)
    grad = torch.ones_like(out)
    with ops:
        out.backward(grad)
    assert ops.forward and ops.backward
    assert not ops.pending  # every kind the step runs was measured when the chain was
    assert scratch_of(ops.forward) == max(s.forward_scratch_bytes for s in chain.stages) > 0
    assert scratch_of(ops.backward) == max(s.backward_scratch_bytes for s in chain.stages) > 0
    # A chain from shapes, for a device one may not have, carries none.
    assert all(
        s.forward_scratch_bytes == s.backward_scratch_bytes == 0
        for s in analytic_chain(model, x).stages
    )


def test_a_convolution_takes_at_most_its_tensors_and_its_scratch_from_the_allocator():
    model, x = _model(), torch.randn(4, 8, 24, 24, requires_grad=True)
    stage = profile_chain(model[:1], x, timing="modelled").stages[0]
    conv = model[0]
    conv(x)  # the kernel's first call sets up what later ones reuse

    def forward() -> torch.Tensor:
        return conv(x)

    peak, out = allocator_peak(forward)
    assert peak is not None
    assert peak <= stage.forward_grad_peak_bytes + stage.forward_scratch_bytes
    grad = torch.ones_like(out)
    peak, _ = allocator_peak(lambda: out.backward(grad))
    assert peak is not None
    assert peak <= stage.backward_peak_bytes + stage.backward_scratch_bytes
