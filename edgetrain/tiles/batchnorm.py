"""Batch norm in train mode over tiles with the statistics of the whole batch (torch).

Each rank holds a region of the feature map: the pixels it *owns* (a partition of the map over
the ranks) plus halo pixels that other ranks own. The function is exact by construction:

Forward. Each rank computes, over its owned pixels only, the count, mean and sum of squared
deviations per channel; an all-gather and Chan's pairwise combination (in rank order, so every
rank gets bit-identical numbers) give the global mean and biased variance. The whole local
region, halo included, is normalised with them.

Backward. Every rank's copy of ``y = (x - mean) * invstd * w + b`` contributes to the loss, and the
mean and variance depend on the *owned* copies only. With ``g`` the gradient of the rank's copy
of ``y`` and ``x̂ = (x - mean) * invstd``::

    dx = w * invstd * (g - [owned] (Σ g + x̂ Σ g x̂) / N)

where the sums run over every rank's whole local region (all-reduced) and the correction applies
only to owned pixels. The weight and bias gradients returned are this rank's local sums; the
weight-gradient all-reduce after backward adds them up. Both exchanges are a few hundred bytes
per layer (:meth:`Comm.gather_small`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional

from edgetrain.tiles.comm import Comm
from edgetrain.tiles.recompute import gathered_statistics

_DIMS = (0, 2, 3)


def _channel(t: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1, 1, 1)


def local_statistics(x: torch.Tensor, owned: tuple[slice, slice]) -> torch.Tensor:
    """Count, mean and sum of squared deviations per channel of ``x``'s owned pixels, stacked
    ``(3, C)``: what a rank contributes to the statistics of the whole map."""
    mine = x[:, :, owned[0], owned[1]]
    channels = x.shape[1]
    count = mine.numel() // channels
    if count:
        # batch norm's own statistics kernel: mean and biased variance in one pass
        mean, var = torch.ops.aten.batch_norm_update_stats(mine, None, None, 0.0)
        m2 = var * count
    else:
        mean = m2 = x.new_zeros(channels)
    return torch.stack([mean.new_full((channels,), float(count)), mean, m2])


def combine_statistics(
    parts: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Every rank's :func:`local_statistics`, in rank order, combined (Chan et al., pairwise, so
    every rank gets bit-identical numbers): mean, biased and unbiased variance, and count."""
    channels = parts[0].shape[1]
    total = parts[0].new_zeros(channels)
    g_mean = parts[0].new_zeros(channels)
    g_m2 = parts[0].new_zeros(channels)
    for part in parts:
        n_b, mean_b, m2_b = part[0], part[1], part[2]
        new_total = total + n_b
        delta = mean_b - g_mean
        safe = torch.where(new_total > 0, new_total, torch.ones_like(new_total))
        g_mean = g_mean + delta * n_b / safe
        g_m2 = g_m2 + m2_b + delta.square() * total * n_b / safe
        total = new_total
    unbiased = g_m2 / (total - 1).clamp(min=1)
    return g_mean, g_m2 / total, unbiased, float(total[0].item())


def sum_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``parts`` in rank order: the same, bit for bit, on every rank."""
    sums = parts[0].clone()
    for part in parts[1:]:
        sums += part
    return sums


def correct_owned(
    dx: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    stats: tuple[torch.Tensor, torch.Tensor, float, float],
    sums: torch.Tensor,
    owned: tuple[slice, slice],
) -> None:
    """Subtract from ``dx`` (in place) on the owned pixels what they move through the mean and
    variance: ``(Σg + x̂ Σgx̂) · w·invstd / N``, which is ``k1 * x + k0`` per channel with
    ``x̂ = (x - mean) * invstd``; ``stats`` is (mean, biased variance, eps, count N) and
    ``sums`` the stacked global (Σg, Σgx̂)."""
    mean, var, eps, count = stats
    invstd = torch.rsqrt(var + eps)
    scale = invstd * weight if weight is not None else invstd
    k1 = scale * sums[1] * invstd / count
    k0 = scale * sums[0] / count - k1 * mean
    rows, cols = owned
    mine = dx[:, :, rows, cols]
    mine.sub_(_channel(k0)).addcmul_(x[:, :, rows, cols], _channel(k1), value=-1.0)


class _GlobalBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        owned: tuple[slice, slice],
        eps: float,
        comm: Comm,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # A recomputation replays the forward's gather (edgetrain.tiles.recompute).
        parts = gathered_statistics(comm, local_statistics(x, owned))
        mean, var, unbiased, count = combine_statistics(parts)
        # Normalising with given statistics is batch norm's inference kernel: one fused pass.
        y = functional.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.owned, ctx.eps, ctx.comm, ctx.count = owned, eps, comm, count
        ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
        ctx.mark_non_differentiable(mean, unbiased)
        return y, mean, unbiased

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor, _mean: torch.Tensor, _var: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, var = ctx.saved_tensors
        # The inference-mode backward kernel gives, in one pass, g * invstd * w (the direct
        # part of dx), the sum of g * x̂ (the weight gradient) and the sum of g (the bias's).
        dx, sum_gx, sum_g = torch.ops.aten.native_batch_norm_backward(
            grad, x, weight, mean, var, None, None, False, ctx.eps, [True, True, True]
        )
        sums = sum_in_order(ctx.comm.gather_small(torch.stack([sum_g, sum_gx])))
        correct_owned(dx, x, weight, (mean, var, ctx.eps, ctx.count), sums, ctx.owned)
        grad_weight = sum_gx if ctx.has_weight else None
        grad_bias = sum_g if ctx.has_bias else None
        return dx, grad_weight, grad_bias, None, None, None


def update_running_statistics(
    bn: nn.BatchNorm2d, mean: torch.Tensor, unbiased: torch.Tensor
) -> None:
    """Update ``bn``'s running statistics from the whole map's, as ``nn.BatchNorm2d`` does."""
    if not (bn.training and bn.track_running_stats):
        return
    assert bn.running_mean is not None and bn.running_var is not None
    assert bn.num_batches_tracked is not None
    with torch.no_grad():
        bn.num_batches_tracked.add_(1)
        tracked = float(bn.num_batches_tracked)
        momentum = 1.0 / tracked if bn.momentum is None else bn.momentum
        bn.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        bn.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


def global_statistics(bn: nn.BatchNorm2d) -> bool:
    """Whether ``bn`` normalises with the statistics of the batch (train mode, or no running
    statistics to use), so tiles need the whole map's."""
    return bn.training or not bn.track_running_stats


def global_batch_norm(
    x: torch.Tensor, bn: nn.BatchNorm2d, owned: tuple[slice, slice], comm: Comm
) -> torch.Tensor:
    """Apply ``bn`` to a local region ``x`` of which ``owned`` (slices into ``x``) is this rank's.

    In train mode (or without running statistics) the statistics are those of the whole map
    over all ranks, and the running statistics are updated from them exactly as
    ``nn.BatchNorm2d`` does, identically on every rank. In eval mode it is element-wise.
    """
    if not global_statistics(bn):
        return nn.functional.batch_norm(
            x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps
        )
    y, mean, unbiased = _GlobalBatchNorm.apply(x, bn.weight, bn.bias, owned, bn.eps, comm)
    update_running_statistics(bn, mean, unbiased)
    return y  # type: ignore[no-any-return]
