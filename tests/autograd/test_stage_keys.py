"""Memo keys of stages: what a stage computes, its captured segments' code included."""

import torch
from torch import fx, nn

from edgetrain.autograd.stages import module_key


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Shift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def _segment(module: nn.Module) -> fx.GraphModule:
    """A captured segment, named as capture names them."""
    return fx.GraphModule(module, fx.symbolic_trace(module).graph)


def test_groups_of_captured_segments_that_compute_differently_have_different_keys():
    double, shift = _segment(Double()), _segment(Shift())
    assert repr(nn.Sequential(double)) == repr(nn.Sequential(shift))  # the segments' code aside
    assert module_key(nn.Sequential(double)) != module_key(nn.Sequential(shift))
    assert module_key(nn.Sequential(double)) == module_key(nn.Sequential(_segment(Double())))
