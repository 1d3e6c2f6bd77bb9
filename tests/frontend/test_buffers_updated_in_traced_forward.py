"""A module outside torch.nn whose forward() updates its own buffers in place (timm's
BatchNormAct2d counts its batches) is updated exactly as under plain autograd, once per step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.runtime.checkpointed import Checkpointed


class CountingBatchNorm(nn.BatchNorm2d):
    """timm's BatchNormAct2d in brief: BatchNorm that counts its own batches, then ReLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return F.relu(
            F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias,
                self.training, factor, self.eps,
            )
        )  # fmt: skip


class Net(nn.Module):
    """Not an nn.Sequential, so that torch.fx captures it (and traces into the subclass)."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, 6, 3, padding=1) for c in (3, 6, 6))
        self.norms = nn.ModuleList(CountingBatchNorm(6, momentum=momentum) for _ in range(3))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norms[0](self.convs[0](x))
        for conv, norm in zip(self.convs[1:], self.norms[1:], strict=True):
            x = norm(conv(x)) + x
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("budget", [{"max_recompute": 1.0}, {"max_recompute": 3.0}])
def test_a_batchnorm_counting_its_own_batches_counts_once_per_step(momentum, budget):
    torch.manual_seed(0)
    model = Net(momentum).double()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    net = Checkpointed(model, x, chain=analytic_chain(model, x), **budget)
    for (name, buf), other in zip(plain.named_buffers(), model.buffers(), strict=True):
        assert torch.equal(buf, other), f"capturing changed {name}"
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
        for module in (plain, net):
            module(x).square().sum().backward()
        for (name, buf), other in zip(plain.named_buffers(), model.buffers(), strict=True):
            assert torch.equal(buf, other), f"step {step}: {name}"
        for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name}"


class CountsItself(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.linear(x).relu()


def test_a_model_whose_own_forward_updates_a_buffer_is_refused_in_one_line_and_left_as_it_was():
    model = CountsItself()
    with pytest.raises(InvalidInput, match="updates the buffer 'calls' in place"):
        Checkpointed(model, torch.randn(2, 4), max_recompute=1.0)
    assert model.calls.item() == 0
