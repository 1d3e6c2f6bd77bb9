"""Checkpointed's budget: one fixed part (what a step starts with in the loop it plans for) in
``fixed_bytes``, in the error and in the plan; the smallest budget an error reports plans."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from edgetrain.errors import InfeasibleBudget
from edgetrain.planners import FRONTIER_STRATEGIES
from edgetrain.runtime.checkpointed import Checkpointed
from edgetrain.units import format_bytes


def linear_bn_tanh() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(5):
        layers += [nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh()]
    return nn.Sequential(*layers).double()


def sample() -> torch.Tensor:
    return torch.randn(8, 6, dtype=torch.float64, requires_grad=True)


def step(net: nn.Module, x: torch.Tensor) -> None:
    net(x).square().mean().backward()


@pytest.mark.parametrize("strategy", FRONTIER_STRATEGIES)
def test_a_budget_below_the_fixed_part_reports_a_smallest_that_plans(strategy):
    model, x = linear_bn_tanh(), sample()
    plain = Checkpointed(model, x, strategy=strategy)
    with pytest.raises(InfeasibleBudget) as info:  # planned on the profiled chain: its scratch
        Checkpointed(
            model, x, memory_budget=plain.fixed_bytes - 8, strategy=strategy, chain=plain.chain
        )
    # The error's fixed part is fixed_bytes, one number.
    assert f"the step starts with {format_bytes(plain.fixed_bytes)}" in str(info.value)
    smallest = info.value.smallest
    assert smallest is not None and smallest > plain.fixed_bytes
    net = Checkpointed(model, x, memory_budget=smallest, strategy=strategy, chain=plain.chain)
    assert net.fixed_bytes == plain.fixed_bytes
    assert net.predicted_peak_bytes <= smallest
    # Every budget between the fixed part and the smallest reports that same smallest.
    for budget in (plain.fixed_bytes + 1, (plain.fixed_bytes + smallest) // 2, smallest - 1):
        with pytest.raises(InfeasibleBudget) as again:
            Checkpointed(model, x, memory_budget=budget, strategy=strategy, chain=plain.chain)
        assert again.value.smallest == smallest
    step(net, x)  # and it trains


def test_the_fixed_part_holds_the_gradients_in_the_loop_that_keeps_them():
    model, x = linear_bn_tanh(), sample()
    net = Checkpointed(model, x, memory_budget="1MB")
    created = net.fixed_bytes
    step(net, x)  # gradients now exist, and the loop keeps them
    step(net, x)
    assert net.grads_exist
    assert net.fixed_bytes == created + net.chain.gradient_bytes
    assert net.predicted_peak_bytes <= 2**20
    with pytest.raises(InfeasibleBudget) as info:
        Checkpointed(model, x, memory_budget=net.fixed_bytes - 8)
    assert f"the step starts with {format_bytes(net.fixed_bytes)}" in str(info.value)
    again = Checkpointed(model, x, memory_budget=info.value.smallest, chain=net.chain)
    assert again.grads_exist and again.predicted_peak_bytes <= info.value.smallest


def test_min_and_auto_budgets_are_points_of_the_models_frontier():
    from edgetrain.runtime.frontier import frontier, knee

    model, x = linear_bn_tanh(), sample()
    assert len(frontier(model, x)) > 2  # profiled as Checkpointed profiles it
    net = Checkpointed(model, x)
    points = frontier(net.chain, fixed_bytes=net.fixed_bytes, grads_exist=net.grads_exist)
    assert points[-1].recompute_factor == pytest.approx(1.0, rel=1e-12) and len(points) > 2
    assert all(a.budget_bytes < b.budget_bytes for a, b in itertools.pairwise(points))
    smallest = Checkpointed(model, x, memory_budget="min", chain=net.chain)
    assert smallest.predicted_peak_bytes <= points[0].budget_bytes
    with pytest.raises(InfeasibleBudget):
        Checkpointed(model, x, memory_budget=points[0].budget_bytes - 1, chain=net.chain)
    auto = Checkpointed(model, x, memory_budget="auto", chain=net.chain)
    chosen = knee(points)
    assert points[0].budget_bytes < chosen.budget_bytes < points[-1].budget_bytes
    assert auto.predicted_peak_bytes <= chosen.budget_bytes
    assert auto.cost.seconds <= chosen.seconds + 1e-12
    step(auto, x)
