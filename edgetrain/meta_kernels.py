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


class _Calls(TorchFunctionMode):
    """Catches a model's own calls of attention (``F.scaled_dot_product_attention``, however
    imported). A call inside another overridable function (``F.multi_head_attention_forward``)
    is not seen by a mode: :func:`cpu_kernels` patches torch's module attribute for those."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return (_attention if func is _SDPA else func)(*args, **(kwargs or {}))


@contextmanager
def cpu_kernels() -> Iterator[None]:
    """Within it, attention on meta tensors runs the kernel the CPU would run for it; on other
    tensors it is unchanged."""
    F.scaled_dot_product_attention = _attention
    try:
        with _Calls():
            yield
    finally:
        F.scaled_dot_product_attention = _SDPA
