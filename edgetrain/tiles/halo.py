"""The halo exchange at the start of a group, forward and backward (torch).

Forward: a rank holds its tile of the previous group's output and needs a larger region of it.
It keeps the part of its tile inside that region, receives the rest from the neighbours that own
it, and sends them the parts of its tile that they need. Backward: the gradient of that region
goes the other way: the parts outside the rank's tile are *gradient halos* sent to their owners,
who add them to the gradient of their tile. Both are non-blocking exchanges
(:meth:`Comm.exchange`), so there is no deadlock whatever the neighbours' order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from edgetrain.tiles.comm import Comm
from edgetrain.tiles.tiling import GroupPlan, Region, region_slices


@dataclass(frozen=True)
class HaloSpec:
    """What one rank sends and receives at one group's input (local coordinates).

    The assembled region also carries the zero (or -inf) padding the group's first layer needs at
    true image borders, so that layer runs without another copy.

    Attributes:
        shape: ``(height, width)`` of the assembled region, padding included.
        tile_shape: ``(height, width)`` of the rank's own tile of the group input.
        keep_from, keep_to: the part of its tile it keeps, in tile and in region coordinates.
        sends: ``(peer, region of the tile)`` the rank sends.
        receives: ``(peer, region of the assembled region)`` it receives.
        borders: the padding strips of the assembled region.
        fill: the padding value (0, or -inf before max pooling).
        tag: the message tag (the group's index), twice: forward ``2 t``, backward ``2 t + 1``.
    """

    shape: tuple[int, int]
    tile_shape: tuple[int, int]
    keep_from: Region
    keep_to: Region
    sends: tuple[tuple[int, Region], ...]
    receives: tuple[tuple[int, Region], ...]
    borders: tuple[Region, ...]
    fill: float
    tag: int

    @staticmethod
    def of(
        group: GroupPlan, rank: int, index: int, fill: float = 0.0, padded: bool = True
    ) -> HaloSpec:
        """The exchange at ``group``'s input; without ``padded`` the region holds no border
        padding (it is added after the element-wise work that follows a merged batch norm)."""
        need, tile = group.input(rank), group.owned(0, rank)
        left, right, top, bottom = group.pads(0, rank) if padded else (0, 0, 0, 0)
        height, width = need.height + top + bottom, need.width + left + right
        padded = Region(need.top - top, need.bottom + bottom, need.left - left, need.right + right)
        keep = need.intersect(tile)
        transfers = group.transfers()
        strips = (
            Region(0, top, 0, width),
            Region(height - bottom, height, 0, width),
            Region(top, height - bottom, 0, left),
            Region(top, height - bottom, width - right, width),
        )
        return HaloSpec(
            shape=(height, width),
            tile_shape=(tile.height, tile.width),
            keep_from=keep.relative_to(tile),
            keep_to=keep.relative_to(padded),
            sends=tuple((t.dst, t.region.relative_to(tile)) for t in transfers if t.src == rank),
            receives=tuple(
                (t.src, t.region.relative_to(padded)) for t in transfers if t.dst == rank
            ),
            borders=tuple(r for r in strips if not r.empty),
            fill=fill,
            tag=index,
        )


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tile: torch.Tensor, spec: HaloSpec, comm: Comm) -> torch.Tensor:  # type: ignore[override]
        n, c = tile.shape[:2]
        buffers = [(peer, tile.new_empty(n, c, r.height, r.width)) for peer, r in spec.receives]
        sends = [(peer, tile[region_slices(r)]) for peer, r in spec.sends]
        out = tile.new_empty(n, c, *spec.shape)
        for strip in spec.borders:
            out[region_slices(strip)] = spec.fill
        if not spec.keep_to.empty:
            out[region_slices(spec.keep_to)] = tile[region_slices(spec.keep_from)]
        comm.exchange(sends, buffers, 2 * spec.tag)
        for (_, region), (_, buffer) in zip(spec.receives, buffers, strict=True):
            out[region_slices(region)] = buffer
        ctx.spec, ctx.comm = spec, comm
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        spec: HaloSpec = ctx.spec
        n, c = grad.shape[:2]
        buffers = [(peer, grad.new_empty(n, c, r.height, r.width)) for peer, r in spec.sends]
        sends = [(peer, grad[region_slices(r)]) for peer, r in spec.receives]
        if spec.keep_from.height * spec.keep_from.width == spec.tile_shape[0] * spec.tile_shape[1]:
            out = grad.new_empty(n, c, *spec.tile_shape)  # the kept part covers the whole tile
        else:
            out = grad.new_zeros(n, c, *spec.tile_shape)
        if not spec.keep_to.empty:
            out[region_slices(spec.keep_from)] = grad[region_slices(spec.keep_to)]
        ctx.comm.exchange(sends, buffers, 2 * spec.tag + 1)
        for (_, region), (_, buffer) in zip(spec.sends, buffers, strict=True):
            out[region_slices(region)] += buffer
        return out, None, None


def exchange_halo(tile: torch.Tensor, spec: HaloSpec, comm: Comm) -> torch.Tensor:
    """The region a group needs, padded at image borders, from ``tile`` and the neighbours."""
    return _Halo.apply(tile, spec, comm)  # type: ignore[no-any-return]
