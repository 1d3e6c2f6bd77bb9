"""torch.nn containers with layers inside, traced into so that a model is cut between layers.

torch.fx keeps every ``torch.nn`` module as one call (a leaf), so a model built around
``nn.TransformerEncoder`` would be one stage for the whole encoder: no plan could recompute less
than all of it. The capture's tracer (:mod:`edgetrain.frontend.fx_capture`) traces into the
containers below instead, through :func:`traced_forward`: each is the container's own
training-mode computation, written without the checks torch's ``forward()`` makes on the input's
shape and on nested tensors (fx cannot branch on a traced shape). The same modules run the same
operations in the same order, so gradients, dropout's random numbers and the results are those of
the module itself.

A container is kept whole (one stage) when its forward could take another path than the one
written here, and :func:`kept_whole_reason` says why: in eval mode (torch's fused fast path),
with a mask, a padding mask or a causal flag given (torch canonicalises and inspects them), and
a multi-layer RNN (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``: one fused kernel over all its layers).
``nn.MultiheadAttention`` stays one call: it is one attention, not a container of layers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

_MASKS = {
    nn.TransformerEncoder: ("mask", "src_key_padding_mask", "is_causal"),
    nn.TransformerEncoderLayer: ("src_mask", "src_key_padding_mask", "is_causal"),
    nn.TransformerDecoder: (
        "tgt_mask",
        "memory_mask",
        "tgt_key_padding_mask",
        "memory_key_padding_mask",
        "tgt_is_causal",
        "memory_is_causal",
    ),
    nn.TransformerDecoderLayer: (
        "tgt_mask",
        "memory_mask",
        "tgt_key_padding_mask",
        "memory_key_padding_mask",
        "tgt_is_causal",
        "memory_is_causal",
    ),
    nn.Transformer: (
        "src_mask",
        "tgt_mask",
        "memory_mask",
        "src_key_padding_mask",
        "tgt_key_padding_mask",
        "memory_key_padding_mask",
        "src_is_causal",
        "tgt_is_causal",
        "memory_is_causal",
    ),
}
"""The containers traced into, and the arguments that must be absent (None or False) for it."""


def is_container(module: nn.Module) -> bool:
    """Whether ``module`` is a torch.nn container with layers inside (traced into, or kept
    whole with a reason)."""
    return type(module) in _MASKS or _multi_layer_rnn(module)


def kept_whole_reason(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Why ``module`` (a container, :func:`is_container`) stays one stage for this call, or ""
    when it is traced into."""
    name = f"nn.{type(module).__name__}"
    if _multi_layer_rnn(module):
        return f"{name} runs its {module.num_layers} layers in one fused kernel"
    if not module.training:
        return f"{name} in eval mode may take torch's fused fast path"
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return f"{name} is called with arguments its forward() does not take"
    given = [n for n in _MASKS[type(module)] if _given(bound.arguments.get(n))]
    if given:
        return f"{name} is given {given[0]} (torch's forward inspects it)"
    return ""


def traced_forward(module: nn.Module) -> Callable[..., Any]:
    """What to trace in place of ``module.forward`` (a container traced into: no mask given,
    training mode): its layers called one by one."""
    kind = type(module)
    if kind is nn.TransformerEncoder:
        return lambda src, *_, **__: _encoder(module, src)
    if kind is nn.TransformerEncoderLayer:
        return lambda src, *_, **__: _encoder_layer(module, src)
    if kind is nn.TransformerDecoder:
        return lambda tgt, memory, *_, **__: _decoder(module, tgt, memory)
    if kind is nn.Transformer:
        return lambda src, tgt, *_, **__: module.decoder(tgt, module.encoder(src))
    return module.forward  # nn.TransformerDecoderLayer: its forward has no shape logic


def _encoder(module: nn.TransformerEncoder, src: Any) -> Any:
    # torch's forward without a mask: each layer with is_causal=False, then the norm
    out = src
    for layer in module.layers:
        out = layer(out, src_mask=None, is_causal=False, src_key_padding_mask=None)
    return out if module.norm is None else module.norm(out)


def _encoder_layer(module: nn.TransformerEncoderLayer, src: Any) -> Any:
    # torch's slow path (the one training takes), without a mask
    x = src
    if module.norm_first:
        x = x + module._sa_block(module.norm1(x), None, None, is_causal=False)
        return x + module._ff_block(module.norm2(x))
    x = module.norm1(x + module._sa_block(x, None, None, is_causal=False))
    return module.norm2(x + module._ff_block(x))


def _decoder(module: nn.TransformerDecoder, tgt: Any, memory: Any) -> Any:
    out = tgt
    for layer in module.layers:
        out = layer(out, memory, tgt_is_causal=False, memory_is_causal=False)
    return out if module.norm is None else module.norm(out)


def _multi_layer_rnn(module: nn.Module) -> bool:
    return isinstance(module, nn.RNNBase) and module.num_layers > 1


def _given(value: Any) -> bool:
    """Whether a mask or flag argument is given (not None, not False; a tensor is given)."""
    return value is not None and value is not False
