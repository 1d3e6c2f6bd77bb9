"""What the caller's backward starts from: a model's output, or its own loss.

A model that computes its own loss returns it beside its other outputs (a Hugging Face model
given ``labels`` returns an output object whose ``loss`` is a scalar tensor and whose ``logits``
are the large one), and the caller runs ``out.loss.backward()``: the gradient the caller makes is
the loss's (one element); the logits get theirs inside the backward, from the loss's own
backward. Any other output gets a gradient of its size for each tensor that needs one (a loss
computed by the caller from it leaves one such gradient). The profile, the plain step it
measures and the chain (:attr:`~edgetrain.core.chain.Stage.caller_gradients`) count the same.
"""

from __future__ import annotations

from typing import Any

import torch

from edgetrain.autograd.stages import leaves


def caller_gradients(output: Any) -> tuple[int, ...] | None:
    """The positions (in :func:`~edgetrain.autograd.stages.leaves` order) of the output tensors
    the caller's backward starts from: those that are the output's ``loss`` when it has one
    (a tensor attribute or mapping entry) beside other tensors; None: every one."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        return None
    tensors = leaves(output)
    positions = tuple(i for i, t in enumerate(tensors) if t is loss)
    return positions if positions and len(tensors) > 1 else None


def wanted_by_caller(wanted: list[bool], output: Any) -> list[bool]:
    """``wanted`` (per output tensor, whether a gradient flows to it) keeping only the tensors
    the caller's backward starts from (:func:`caller_gradients`)."""
    positions = caller_gradients(output)
    if positions is None:
        return list(wanted)
    return [w and i in positions for i, w in enumerate(wanted)]
