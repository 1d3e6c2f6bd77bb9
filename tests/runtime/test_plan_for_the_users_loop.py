"""A memory budget plans for the training loop the user runs: ``zero_grad()`` (gradients None at
the step's start, PyTorch's default) or ``zero_grad(set_to_none=False)`` (kept); a change of
loop plans again; a budget plain autograd fits in the loop is never refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgetrain.errors import InfeasibleBudget
from edgetrain.runtime.checkpointed import Checkpointed
from tests.helpers import set_gradients, step_peak


class Repeat(nn.Module):
    """Widen the activation without parameters (the tail holds activations, not weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, 16)


def _model() -> nn.Sequential:
    # The head holds most of the weights (their gradients come last in the backward, after the
    # tail's activations are freed); the tail holds most of the activations.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), Repeat(), nn.Tanh(), nn.Tanh(), nn.Tanh())


def _step(net: nn.Module, model: nn.Module, x: torch.Tensor, set_to_none: bool) -> int:
    """One step in the loop; the whole step's peak of tensors (the fixed part included)."""
    set_gradients(model.parameters(), kept=not set_to_none)
    held = [*model.parameters(), x, *(p.grad for p in model.parameters() if p.grad is not None)]
    start = sum(t.untyped_storage().nbytes() for t in held)
    # An output-sized gradient, as the plans count.
    return start + step_peak(net, x, backward=lambda out: out.backward(torch.ones_like(out)))


def _plain_peaks(model: nn.Module, x: torch.Tensor) -> dict[bool, int]:
    """Plain autograd's whole-step peak in each loop (True: gradients set to None); leaves the
    gradients None, as a new model has them."""
    peaks = {set_to_none: _step(model, model, x, set_to_none) for set_to_none in (True, False)}
    model.zero_grad()
    return peaks


def test_a_budget_plain_autograd_fits_with_zero_grad_is_not_refused():
    model = _model()
    x = torch.randn(8, 512)
    plain = _plain_peaks(model, x)
    assert plain[True] < plain[False]  # in this model the loops differ
    budget = plain[True] + 4096  # plain autograd fits with zero_grad(), not with kept gradients
    net = Checkpointed(model, x, memory_budget=budget)
    assert not net.grads_exist
    assert net.predicted_peak_bytes <= budget
    for _ in range(2):
        measured = _step(net, model, x, set_to_none=True)
        assert measured <= budget
        assert measured <= net.predicted_peak_bytes


def test_a_change_of_loop_plans_again_for_it():
    model = _model()
    x = torch.randn(8, 512)
    plain = _plain_peaks(model, x)
    budget = plain[False] + 4096  # both loops fit
    net = Checkpointed(model, x, memory_budget=budget)
    assert _step(net, model, x, set_to_none=True) <= budget
    none_plan = net.schedule
    assert _step(net, model, x, set_to_none=False) <= budget
    assert net.grads_exist
    assert net.predicted_peak_bytes <= budget
    kept_plan = net.schedule
    assert _step(net, model, x, set_to_none=True) <= budget
    assert net.schedule is none_plan  # the plan of each loop is kept, not made again
    assert _step(net, model, x, set_to_none=False) <= budget
    assert net.schedule is kept_plan


def test_a_budget_only_the_default_loop_fits_is_refused_for_kept_gradients():
    model = _model()
    x = torch.randn(8, 512)
    plain = _plain_peaks(model, x)
    net = Checkpointed(model, x, memory_budget=plain[True] + 4096)
    _step(net, model, x, set_to_none=True)
    kept_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(InfeasibleBudget) as refused:
        _step(net, model, x, set_to_none=False)
    assert "keeps gradients" in str(refused.value)
    assert refused.value.smallest is not None and refused.value.smallest > plain[True]
    assert kept_bytes > 0
    assert _step(net, model, x, set_to_none=True) <= plain[True] + 4096  # still runs
