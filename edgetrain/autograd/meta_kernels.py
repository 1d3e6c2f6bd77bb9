"""Meta tensors that run the kernels the CPU would, so that sizing on them is sizing the CPU's
step.

On the meta device ``F.scaled_dot_product_attention`` always takes its math path (softmax of
``q @ kᵀ``, which saves the attention weights: ``batch × heads × L × L`` per call), where the CPU
takes its fused flash kernel (which saves the output and one log-sum-exp per query row). A
plain-autograd step of a small transformer sized on meta tensors read 18 % above the same step
on the CPU (``nn.MultiheadAttention``, 4 blocks, L = 16). :func:`cpu_kernels` redirects each
meta call to the kernel the CPU picks for the same shapes, dtypes and arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

_SDPA = F.scaled_dot_product_attention
_MISH = F.mish
_FLASH = 1  # torch's SDPBackend.flash_attention, as _fused_sdp_choice returns it
_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in (
            ("query", inspect.Parameter.empty),
            ("key", inspect.Parameter.empty),
            ("value", inspect.Parameter.empty),
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
            ("scale", None),
            ("enable_gqa", False),
        )
    ]
)


def _cpu_stand_in(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``t``'s shape and dtype, contiguous in its last dimension, on one row's
    memory: what the CPU's kernel choice reads (shapes, dtypes, the last dimension's stride)."""
    grad = t.requires_grad and t.is_floating_point()
    return torch.empty(t.shape[-1:], dtype=t.dtype, requires_grad=grad).expand(t.shape)


def _cpu_choice(args: inspect.BoundArguments) -> int:
    """The kernel the CPU picks for these arguments (torch's ``SDPBackend`` number), asked
    with the tensor-counting modes (a ``StorageCounter``) suspended: not part of the step."""
    mask = args.arguments["attn_mask"]
    with _disable_current_modes():
        q, k, v = (_cpu_stand_in(args.arguments[name]) for name in ("query", "key", "value"))
        return int(
            torch._fused_sdp_choice(
                q,
                k,
                v,
                attn_mask=None if mask is None else _cpu_stand_in(mask),
                dropout_p=args.arguments["dropout_p"],
                is_causal=args.arguments["is_causal"],
                scale=args.arguments["scale"],
                enable_gqa=args.arguments["enable_gqa"],
            )
        )


def _flash(args: inspect.BoundArguments) -> torch.Tensor:
    """The CPU's flash attention on meta tensors, after the boolean-mask conversion that
    ``F.scaled_dot_product_attention`` makes first (a float mask of the query's dtype, ``-inf``
    where the mask is False)."""
    q = args.arguments["query"]
    mask = args.arguments["attn_mask"]
    if mask is not None and mask.dtype == torch.bool:
        # One expression, so that the two scalars go as soon as the mask is made (as the
        # CPU's do: a counter sees both runs alike).
        mask = torch.where(
            mask,
            torch.scalar_tensor(0.0, dtype=q.dtype, device=q.device),
            torch.scalar_tensor(-float("inf"), dtype=q.dtype, device=q.device),
        )
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q,
        args.arguments["key"],
        args.arguments["value"],
        args.arguments["dropout_p"],
        args.arguments["is_causal"],
        attn_mask=mask,
        scale=args.arguments["scale"],
    )
    return out


def _attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, on meta tensors as the CPU would run it."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    query = bound.arguments["query"]
    if (
        isinstance(query, torch.Tensor)
        and query.device.type == "meta"
        and not bound.arguments["enable_gqa"]
        and _cpu_choice(bound) == _FLASH
    ):
        return _flash(bound)
    return _SDPA(*args, **kwargs)


class _MishOnMeta(torch.autograd.Function):
    """``mish`` on meta tensors as the CPU runs it: its kernel saves the input and its backward
    kernel makes the input's gradient, one tensor. On meta its backward has no kernel of its own
    and is decomposed (softplus, tanh, sigmoid, products): five tensors of the input's size,
    which read a Linear + Mish MLP's plain step 76 % high (265,232 B against 150,800 B)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.ops.aten.mish.default(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.empty_like(x)  # meta: the shape is all there is


def _mish(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.mish``, on meta tensors (out of place) as the CPU would run it."""
    if isinstance(x, torch.Tensor) and x.device.type == "meta" and not inplace:
        return _MishOnMeta.apply(x)
    return _MISH(x, inplace=inplace)


class _Calls(TorchFunctionMode):
    """Catches a model's own calls of attention (``F.scaled_dot_product_attention``, however
    imported) and of ``F.mish``, and notes in ``unlike_cpu`` the calls on meta tensors whose
    sizes there are not the CPU's (:data:`_UNLIKE_CPU`). A call inside another overridable
    function (``F.multi_head_attention_forward``) is not seen by a mode: :func:`cpu_kernels`
    patches torch's module attribute for those."""

    def __init__(self) -> None:
        super().__init__()
        self.unlike_cpu: set[str] = set()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        unlike = _UNLIKE_CPU.get(func)
        if unlike is not None and any(
            isinstance(a, torch.Tensor) and a.device.type == "meta"
            for a in (*args, *(kwargs or {}).values())
        ):
            self.unlike_cpu.add(unlike)
        return _REDIRECTS.get(func, func)(*args, **(kwargs or {}))


_REDIRECTS: dict[Any, Any] = {_SDPA: _attention, _MISH: _mish}
_UNLIKE_CPU: dict[Any, str] = {
    torch._VF.lstm: "nn.LSTM",  # type: ignore[attr-defined]
    torch._VF.gru: "nn.GRU",  # type: ignore[attr-defined]
    torch._VF.rnn_tanh: "nn.RNN",  # type: ignore[attr-defined]
    torch._VF.rnn_relu: "nn.RNN",  # type: ignore[attr-defined]
    F.unfold: "F.unfold",
    F.fold: "F.fold",
}
"""Calls that meta tensors size unlike the CPU: the recurrent layers (the CPU runs oneDNN's
kernels, which save a workspace: a 2-layer LSTM's plain step read 344 KB on meta where it holds
615 KB; a GRU's reads 8 % high, an LSTM with ``proj_size`` 36 % high), and ``unfold`` and
``fold``, whose CPU kernel ``col2im`` (``fold``, and ``unfold``'s backward) returns its output
on a storage of its input's size (``unfold``'s input gradient: 115,200 B for 18,432 B of
values, exactly 18,432 B on meta)."""


@contextmanager
def cpu_kernels() -> Iterator[set[str]]:
    """Within it, attention and ``mish`` on meta tensors run the kernels the CPU would run for
    them; on other tensors they are unchanged. Yields a set that names, once the block has run,
    the layers it ran on meta tensors that are not sized as the CPU runs them (``"nn.LSTM"``):
    what was sized then is not the CPU's step."""
    F.scaled_dot_product_attention = _attention
    try:
        with _Calls() as calls:
            yield calls.unlike_cpu
    finally:
        F.scaled_dot_product_attention = _SDPA
