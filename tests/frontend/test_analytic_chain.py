"""The chain `plan` makes from shapes alone for a model with a forward() (captured, on meta
tensors) has the byte counts the executor's measured chain has, so a saved plan runs."""

from __future__ import annotations

import torch
from torch import nn

from edgetrain.frontend.cuts import as_stages
from edgetrain.frontend.profiling import analytic_chain, profile_chain
from edgetrain.models import build, model_chain


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.conv(x))


class Net(nn.Module):
    """Two segments that print alike (``GraphModule()``: a tanh and a mean) on inputs of one
    shape: a cost memo keyed on ``repr`` alone would give the mean the tanh's output."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.Sequential(Block(4), Block(4))
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(torch.tanh(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


def test_analytic_chain_of_a_captured_model_has_the_measured_byte_counts():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3, 8, 8)
    analytic = analytic_chain(model, x)
    measured = profile_chain(as_stages(model, x), x, repeats=1)
    assert analytic.length == measured.length > 4
    assert analytic.fingerprint() == measured.fingerprint()
    names = [s.name for s in analytic.stages]
    assert names[0] == "stem" and "tanh" in names and names[-2:] == ["mean", "head"]


def test_model_chain_takes_a_registered_model_with_a_forward():
    torch.manual_seed(0)
    analytic = model_chain("resnet18-module", 2, 32)
    model = build("resnet18-module")
    x = torch.randn(2, 3, 32, 32)
    measured = profile_chain(as_stages(model, x), x, repeats=1)
    assert analytic.name == "resnet18-module"
    assert analytic.fingerprint() == measured.fingerprint()
