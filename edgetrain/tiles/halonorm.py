"""A batch norm and the halo exchange after it in one round of messages (torch).

At a group boundary the next group needs a region of the map around the rank's tile; when the
previous layer ends with a batch norm in train mode, the exchange moves before the batch norm:
each rank sends its neighbours the *unnormalised* pixels they need together with its statistics
(one message per peer instead of two rounds), combines every rank's statistics, and normalises
its tile and the received halo with them. The element-wise work after the batch norm then runs
on the whole region, and the border padding of the next window is added last.

Backward is one round too. The gradient of a halo pixel's normalised copy gives, on the rank
that holds the copy, the direct part of its input gradient ``w·invstd·g`` and its share of the
sums ``Σg`` and ``Σg·x̂``; the rank sends that part to the pixel's owner with its sums. The
owner adds the parts it receives to its tile's gradient and subtracts the correction of its
owned pixels (:func:`~edgetrain.tiles.batchnorm.correct_owned`), exactly as for a batch norm
whose region includes the halo. The halos and statistics are the same bytes as the separate
exchange and statistics messages, in half as many rounds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional

from edgetrain.tiles.batchnorm import (
    combine_statistics,
    correct_owned,
    local_statistics,
    sum_in_order,
    update_running_statistics,
)
from edgetrain.tiles.comm import Comm
from edgetrain.tiles.halo import HaloSpec
from edgetrain.tiles.tiling import Region, region_slices


def _block(grad: torch.Tensor, region: Region) -> torch.Tensor:
    return grad[region_slices(region)]


class _HaloBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        owned: tuple[slice, slice],
        eps: float,
        spec: HaloSpec,
        comm: Comm,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, c = x.shape[:2]
        sends = [(peer, x[region_slices(r)]) for peer, r in spec.sends]
        receives = [(peer, (n, c, r.height, r.width)) for peer, r in spec.receives]
        parts, halos = comm.exchange_with_small(
            local_statistics(x, owned), sends, receives, 2 * spec.tag
        )
        mean, var, unbiased, count = combine_statistics(parts)
        out = x.new_empty(n, c, *spec.shape)
        if not spec.keep_to.empty:
            kept = x[region_slices(spec.keep_from)]
            out[region_slices(spec.keep_to)] = functional.batch_norm(
                kept, mean, var, weight, bias, False, 0.0, eps
            )
        received = []
        for peer, region in spec.receives:
            halo = halos[peer]
            out[region_slices(region)] = functional.batch_norm(
                halo, mean, var, weight, bias, False, 0.0, eps
            )
            received.append(halo)
        ctx.save_for_backward(x, weight, mean, var, *received)
        ctx.owned, ctx.eps, ctx.comm, ctx.count, ctx.spec = owned, eps, comm, count, spec
        ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
        ctx.mark_non_differentiable(mean, unbiased)
        return out, mean, unbiased

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor, _mean: torch.Tensor, _var: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, var, *received = ctx.saved_tensors
        spec: HaloSpec = ctx.spec
        eps = ctx.eps
        mask = [True, True, True]
        if spec.keep_from.height * spec.keep_from.width == x.shape[2] * x.shape[3]:
            g_tile = grad[region_slices(spec.keep_to)]  # the kept part covers the whole tile
        else:
            g_tile = grad.new_zeros(x.shape)
            g_tile[region_slices(spec.keep_from)] = grad[region_slices(spec.keep_to)]
        # The inference-mode backward kernel: the direct part of dx, Σ g·x̂ and Σ g, one pass.
        dx, sum_gx, sum_g = torch.ops.aten.native_batch_norm_backward(
            g_tile, x, weight, mean, var, None, None, False, eps, mask
        )
        sends = []
        for (peer, region), halo in zip(spec.receives, received, strict=True):
            d_halo, gx, g = torch.ops.aten.native_batch_norm_backward(
                _block(grad, region), halo, weight, mean, var, None, None, False, eps, mask
            )
            sum_gx, sum_g = sum_gx + gx, sum_g + g
            sends.append((peer, d_halo))
        n, c = x.shape[:2]
        shapes = [(peer, (n, c, r.height, r.width)) for peer, r in spec.sends]
        local = torch.stack([sum_g, sum_gx])
        parts, back = ctx.comm.exchange_with_small(local, sends, shapes, 2 * spec.tag + 1)
        dx = dx.contiguous()
        for peer, region in spec.sends:
            dx[region_slices(region)] += back[peer]
        stats = (mean, var, eps, ctx.count)
        correct_owned(dx, x, weight, stats, sum_in_order(parts), ctx.owned)
        grad_weight = sum_gx if ctx.has_weight else None
        grad_bias = sum_g if ctx.has_bias else None
        return dx, grad_weight, grad_bias, None, None, None, None


def halo_batch_norm(
    x: torch.Tensor, bn: nn.BatchNorm2d, owned: tuple[slice, slice], spec: HaloSpec, comm: Comm
) -> torch.Tensor:
    """``bn`` in train mode on the rank's tile ``x`` (``owned``: slices into it) and on the halo
    ``spec`` (an exchange without border padding) brings from the neighbours: the normalised
    region the next group reads. The running statistics update as ``nn.BatchNorm2d``'s."""
    y, mean, unbiased = _HaloBatchNorm.apply(x, bn.weight, bn.bias, owned, bn.eps, spec, comm)
    update_running_statistics(bn, mean, unbiased)
    return y  # type: ignore[no-any-return]
