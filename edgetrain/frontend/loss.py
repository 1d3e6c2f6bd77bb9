"""The caller's loss as a stage: profiled on a leaf shaped like the model's output, to be merged
into the chain's last stage (:func:`edgetrain.core.loss.with_loss`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from edgetrain.core.chain import Stage
from edgetrain.frontend.profiling import profile_chain


class _Loss(nn.Module):
    def __init__(self, loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        return self.loss(out)


def profile_loss(
    loss: Callable[[torch.Tensor], torch.Tensor], output: torch.Tensor, *, repeats: int = 1
) -> Stage:
    """``loss`` (the model's output to a scalar) measured as one stage on a leaf of ``output``'s
    shape and dtype that requires grad, as the caller's step runs it."""
    leaf = torch.zeros_like(output.detach()).requires_grad_()
    return profile_chain(nn.Sequential(_Loss(loss)), leaf, repeats=repeats).stages[0]
