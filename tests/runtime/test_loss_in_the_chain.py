"""A chain with the caller's loss merged into its last stage (``with_loss``, the loss profiled
by ``profile_loss``) predicts the whole training step's peak, loss included, as
``StorageCounter`` measures it: on a language model whose logits and loss dominate memory and on
a CNN whose output is small, for plans from the least memory to storing everything (never
below, above by at most 64 bytes, and the output's gradient for the store-all plan, which plain
autograd frees early)."""

import copy

import pytest
import torch
from torch import nn

from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.core.loss import with_loss
from edgetrain.core.schedule import made_for
from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget
from edgetrain.frontend.cuts import as_stages
from edgetrain.frontend.loss import profile_loss
from edgetrain.frontend.profiling import profile_chain
from edgetrain.models.tiny_lm import TinyLM
from edgetrain.planners import plan
from edgetrain.planners.optimal import store_all
from edgetrain.runtime.checkpointed import Checkpointed


def _loss(out: torch.Tensor) -> torch.Tensor:
    """The step's loss: the mean of the output's squares."""
    return out.float().square().mean()


class WithLoss:
    """A model's profiled chain and the chain with the loss merged in, to plan the whole step."""

    def __init__(self, model: nn.Module, x: torch.Tensor) -> None:
        self.model, self.x = model, x
        self.chain = _profiled(model, x)
        with torch.no_grad():
            self.planning = with_loss(self.chain, profile_loss(_loss, model(x)))

    def least_bytes(self) -> int:
        try:
            return int(simulate(self.planning, plan(self.planning, "optimal", memory=1)).peak_bytes)
        except InfeasibleBudget as exc:
            assert exc.smallest is not None
            return int(exc.smallest)

    def net(self, budget: int, merge_graph_runs: bool = True) -> Checkpointed:
        schedule = made_for(plan(self.planning, "optimal", memory=budget), self.chain)
        return Checkpointed(
            copy.deepcopy(self.model),
            self.x,
            chain=self.chain,
            schedule=schedule,
            merge_graph_runs=merge_graph_runs,
        )

    def predicted(self, schedule):
        return simulate(self.planning, schedule)


def _training_step(net, params, x):
    def step() -> None:
        _loss(net(x)).backward()
        for p in params:  # as zero_grad() would; after the step, so each starts without them
            p.grad = None

    return step


def _profiled(model, x):
    """The model's chain measured on this machine, as ``Checkpointed`` profiles it (each stage
    timed once: the times do not matter here)."""
    return profile_chain(as_stages(model, x), x, repeats=1)


class SmallCNN(nn.Module):
    """A user's CNN: convolutions with BatchNorm and ReLU, a residual addition, a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.SiLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.body(x)
        return self.head(self.down(x).mean((2, 3)))


CASES = [
    (
        "tinylm",
        lambda: TinyLM(vocab=2048, context=32, dim=32, depth=2, heads=2),
        lambda: torch.randint(0, 2048, (4, 32)),
    ),
    ("cnn", SmallCNN, lambda: torch.randn(4, 3, 32, 32)),
]


@pytest.mark.parametrize(("name", "make", "make_input"), CASES, ids=[c[0] for c in CASES])
def test_step_peak_with_the_loss_is_predicted_exactly(name, make, make_input):
    # Stage by stage, as planned: a plan run as one graph keeps a LayerNorm's statistics too (a
    # few KiB), which the planning chain does not count; the benchmark measures every row's
    # peak for that, and the executor sizes one graph as it runs (test_contract.py).
    torch.manual_seed(0)
    model, x = make(), make_input()
    planned = WithLoss(model, x)
    least = planned.least_bytes()
    most = simulate(planned.planning, store_all(planned.planning)).peak_bytes
    assert least < most
    out_grad = planned.chain.gradient_of_activation_bytes(planned.chain.length)
    for budget in (least, (least + most) // 2, most):
        net = planned.net(budget, merge_graph_runs=False)
        predicted = planned.predicted(net.schedule).peak_bytes
        assert predicted <= budget
        step = _training_step(net, list(net.module.parameters()), x)
        step()  # warm-up, as the benchmark does
        counter = StorageCounter()
        with counter:
            step()
        # Never below the measurement; above it by at most a few scalars, and for a plan that
        # plain autograd runs (storing everything: the model as it is) by the output's
        # gradient: plain autograd frees it as soon as it is used.
        slack = out_grad if net._stores_everything else 0
        assert 0 <= predicted - counter.peak_bytes <= 64 + slack, (name, budget)


def test_loss_is_not_counted_twice_nor_at_the_chains_peak():
    """On a language model the loss (the logits' square, the gradients of the mean and the
    square: four logits-sized tensors with the output's gradient) sits on top of what the plan
    holds when the forward ends. The least plan's step is then below the chain's least peak plus
    everything the loss holds: the loss is not a reserve on top of the peak."""
    torch.manual_seed(0)
    model = TinyLM(vocab=2048, context=32, dim=32, depth=2, heads=2)
    x = torch.randint(0, 2048, (4, 32))
    planned = WithLoss(model, x)
    net = planned.net(planned.least_bytes())
    leaf = torch.zeros(4, 32, 2048, requires_grad=True)
    counter = StorageCounter()
    with counter:
        _loss(leaf).backward()
    step = _training_step(net, list(net.module.parameters()), x)
    step()
    measured = StorageCounter()
    with measured:
        step()
    assert measured.peak_bytes < net.cost.peak_bytes + counter.peak_bytes
