"""The caller's backward starts from a model's own loss when its output carries one: only the
loss gets the caller's gradient, in the chain's count as in the step."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from edgetrain import Checkpointed, StorageCounter
from edgetrain.frontend.caller_gradient import caller_gradients, wanted_by_caller


class WithLoss(nn.Module):
    """A model that returns its loss beside its logits, as a Hugging Face model given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 500)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.body(x))
        loss = nn.functional.cross_entropy(logits, labels)
        return OrderedDict(loss=loss, logits=logits)


def test_the_loss_is_where_the_callers_backward_starts():
    logits, loss = torch.ones(4, 3, requires_grad=True), torch.ones((), requires_grad=True)
    assert caller_gradients({"loss": loss, "logits": logits}) == (0,)
    assert caller_gradients({"logits": logits, "loss": loss}) == (1,)
    assert caller_gradients(logits) is None  # one tensor: its gradient is the caller's
    assert caller_gradients({"logits": logits}) is None
    assert wanted_by_caller([True, True], {"loss": loss, "logits": logits}) == [True, False]


def test_a_model_with_its_own_loss_measures_its_prediction():
    torch.manual_seed(0)
    model = WithLoss().double()
    inputs = {"x": torch.randn(32, 16, dtype=torch.float64), "labels": torch.randint(0, 500, (32,))}
    net = Checkpointed(model, inputs, memory_budget="min")
    last = net.chain.stages[-1]
    assert last.caller_gradients is not None
    output_gradient = net.chain.gradient_of_activation_bytes(net.chain.length)
    assert output_gradient < 32 * 500 * 8  # the loss's, not the logits'
    for p in net.parameters():
        p.grad = None
    counter = StorageCounter()
    with counter:
        outputs = net(**inputs)  # held through the backward, as a training loop holds them
        outputs["loss"].backward()
        del outputs
    assert counter.peak_bytes == net.cost.peak_bytes
