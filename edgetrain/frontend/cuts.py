"""Model to stages: the pieces edgetrain plans over and runs one at a time."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.frontend.fx_capture import block_cuts, capture, segments


def as_stages(model: nn.Module, sample: Any) -> nn.Sequential:
    """The stages edgetrain plans over: a plain ``nn.Sequential`` as it is; any other module
    captured with torch.fx (:mod:`edgetrain.frontend.fx_capture`) and cut between its blocks (where
    a single
    tensor crosses) and twice inside each (where the trunk and the skip cross, see
    :func:`~edgetrain.frontend.fx_capture.block_cuts`), each piece an ``fx.GraphModule`` running the
    model's own modules."""
    if isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward:
        check_sequential(model)
        return model
    if not isinstance(sample, torch.Tensor):
        raise InvalidInput(
            f"{type(model).__name__} is captured with torch.fx, which edgetrain calls with one "
            f"input tensor; the sample is a {type(sample).__name__}: give forward() one tensor "
            "(an nn.Sequential may pass tuples, lists or dicts between its entries)"
        )
    captured = capture(model, sample)
    stages = segments(captured, block_cuts(captured))
    stages.traced_reads = captured.reads  # what Checkpointed._state watches
    return stages


def check_sequential(model: object) -> None:
    """Refuse what is not a plain, non-empty ``nn.Sequential`` (one line each)."""
    if not isinstance(model, nn.Sequential):
        raise InvalidInput(
            f"edgetrain plans over the children of an nn.Sequential, got {type(model).__name__}; "
            "wrap the model's blocks in nn.Sequential(...)"
        )
    if type(model).forward is not nn.Sequential.forward:
        raise InvalidInput(
            f"{type(model).__name__} overrides nn.Sequential.forward, which edgetrain would not "
            "run (it runs the children in order); pass a plain nn.Sequential of the blocks"
        )
    if len(model) == 0:
        raise InvalidInput("the nn.Sequential has no children; give a model with layers")
