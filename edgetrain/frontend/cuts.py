"""Model to stages: the pieces edgetrain plans over and runs one at a time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.frontend.fx_capture import block_cuts, capture, segments


def as_stages(
    model: nn.Module, sample: Any, *, leaf_modules: Sequence[type[nn.Module]] = ()
) -> nn.Sequential:
    """The stages edgetrain plans over: a plain ``nn.Sequential`` as it is; any other module
    captured with torch.fx (:mod:`edgetrain.frontend.fx_capture`) and cut between its blocks (where
    a single
    tensor crosses) and twice inside each (where the trunk and the skip cross, see
    :func:`~edgetrain.frontend.fx_capture.block_cuts`), each piece an ``fx.GraphModule`` running the
    model's own modules. ``sample`` is one tensor, or a mapping of ``forward()``'s keyword
    arguments to tensors (then the first stage takes them as :func:`stage_input` orders them);
    ``leaf_modules``: module classes kept as one call each, not traced into."""
    if isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward:
        check_sequential(model)
        return model
    if not isinstance(sample, torch.Tensor | Mapping):
        raise InvalidInput(
            f"{type(model).__name__} is captured with torch.fx, which edgetrain calls with one "
            f"input tensor; the sample is a {type(sample).__name__}: give forward() one tensor, "
            "or a dict of its keyword arguments (called as net(**inputs)); an nn.Sequential may "
            "pass tuples, lists or dicts between its entries"
        )
    captured = capture(model, sample, leaf_modules=leaf_modules)
    stages = segments(captured, block_cuts(captured))
    stages.traced_reads = captured.reads  # what Checkpointed._state watches
    stages.input_names = captured.inputs if isinstance(sample, Mapping) else None
    return stages


def stage_input(stages: nn.Module, sample: Any) -> Any:
    """``sample`` as the first stage takes it: a mapping of keyword arguments (for stages
    :func:`as_stages` made from one) as the tensor, or the tuple of tensors, in the order of
    the captured inputs; anything else (a dict an ``nn.Sequential`` takes as one input) as it
    is."""
    names = getattr(stages, "input_names", None)
    if not isinstance(sample, Mapping) or names is None:
        return sample  # a dict an nn.Sequential takes as its one input stays one
    if set(names) != set(sample):
        raise InvalidInput(
            f"the model was captured for {', '.join(names)}, called with keyword inputs "
            f"{', '.join(map(str, sample))}; call it with the inputs it was captured for"
        )
    values = tuple(sample[name] for name in names)
    return values[0] if len(values) == 1 else values


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


class KeywordCall(nn.Module):
    """``module`` called with the first stage's input (:func:`stage_input`) as the keyword
    arguments it stands for: the user's model as the stages' input runs it."""

    def __init__(self, module: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.module = module
        self.names = tuple(names)

    def forward(self, x: Any) -> Any:
        values = (x,) if len(self.names) == 1 else tuple(x)
        return self.module(**dict(zip(self.names, values, strict=True)))


def on_stage_input(module: nn.Module, stages: nn.Module) -> nn.Module:
    """``module`` as a module taking the first stage's input: itself, or a :class:`KeywordCall`
    for stages captured from keyword inputs."""
    names = getattr(stages, "input_names", None)
    return module if names is None else KeywordCall(module, names)
