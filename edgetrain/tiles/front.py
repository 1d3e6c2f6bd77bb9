"""The tiled front of a graph model and where it ends: geometry and cost (pure: no torch).

A captured model is a list of operations in topological order. Every feature map of the *front*
is cut by the grid the same way (:meth:`~edgetrain.tiles.grid.Grid.row_spans` per axis, equal
tiles or the shares of boards that differ), so tiles of two maps of one size line up and
element-wise operations, residual additions and channel concatenations run tile by tile. A
window (convolution, pooling, transposed convolution) reads a span of its input per output tile:
its halo comes from the ranks that own it (one exchange per window). Past the *cut* the rest of
the model runs on every rank on the gathered map; global average pooling is a sum over tiles, so
it needs an all-reduce of one value per channel only.

:func:`front_cost` prices a placement of the operations (which run on tiles, which maps are
gathered, which are summed) with the same device and link model as the grouping optimiser
(:mod:`edgetrain.tiles.grouping`); the torch side (:mod:`edgetrain.tiles.graph`) tries every cut
and keeps the cheapest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edgetrain.devices.cluster import Cluster
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.grouping import (
    allreduce_seconds,
    exchange_seconds,
    small_collective_seconds,
    weight_sync_seconds,
)
from edgetrain.tiles.tiling import Region, Span, Transfer, Window


def transposed_needed(out: Span, window: Window, size: int) -> Span:
    """The input span (clipped to ``size``) whose transposed-convolution outputs reach ``out``.

    Input ``i`` writes outputs ``[i*stride - padding, i*stride - padding + extent)``.
    """
    a, b = out
    s, p, e = window.stride, window.padding, window.extent
    first = max(0, (a + p - e) // s + 1)
    last = min(size - 1, (b - 1 + p) // s)
    return (first, max(first, last + 1))


def window_transfers(
    grid: Grid,
    in_size: tuple[int, int],
    needed_rows: tuple[Span, ...],
    needed_cols: tuple[Span, ...],
) -> tuple[Transfer, ...]:
    """Halo messages of one window: rank ``dst`` needs ``needed_rows[i] x needed_cols[j]``
    (clipped) of a map whose tiles the grid owns; who sends which owned pixels to whom."""
    own_rows, own_cols = grid.row_spans(in_size[0]), grid.col_spans(in_size[1])
    out = []
    for dst in range(grid.size):
        i, j = grid.position(dst)
        need = Region.of(needed_rows[i], needed_cols[j])
        for src in range(grid.size):
            if src != dst:
                si, sj = grid.position(src)
                region = need.intersect(Region.of(own_rows[si], own_cols[sj]))
                if not region.empty:
                    out.append(Transfer(src, dst, region))
    return tuple(out)


@dataclass(frozen=True)
class FrontOp:
    """One operation of a captured model as a placement runs it (one step, the whole batch).

    Attributes:
        name: the graph node's name.
        placement: ``"tiled"`` (on each rank's tile), ``"replicated"`` (whole, on every rank),
            ``"summed"`` (a sum over tiles, then an all-reduce) or ``"none"`` (no tensor work).
        macs: forward multiply-accumulates of the untiled operation.
        tile_fractions: each rank's share of the map (empty: the whole map on every rank).
        transfers: halo messages of a tiled window, and the bytes of each.
        gathered_bytes: bytes of tiled maps this operation needs whole (all-gathered first).
        summed_bytes: bytes all-reduced by a sum over tiles.
        batchnorm_bytes: bytes of one statistics message of a batch norm on tiles (else 0).
    """

    name: str
    placement: str
    macs: int
    tile_fractions: tuple[float, ...] = ()
    transfers: tuple[Transfer, ...] = ()
    transfer_bytes: tuple[int, ...] = ()
    gathered_bytes: int = 0
    summed_bytes: int = 0
    batchnorm_bytes: int = 0


@dataclass(frozen=True)
class FrontCost:
    """Predicted seconds of one training step of a placement (forward + backward)."""

    cut: int
    compute_seconds: float
    halo_seconds: float
    gather_seconds: float
    collective_seconds: float
    weights_seconds: float
    halo_bytes: int
    gathered_bytes: int

    @property
    def seconds(self) -> float:
        return (
            self.compute_seconds
            + self.halo_seconds
            + self.gather_seconds
            + self.collective_seconds
            + self.weights_seconds
        )


def front_cost(
    cut: int,
    ops: tuple[FrontOp, ...],
    gradient_bytes: Sequence[int],
    grid: Grid,
    cluster: Cluster,
) -> FrontCost:
    """The cost of running ``ops`` (placed for ``cut``) on ``grid``: the slowest rank's compute
    (tiles share the front, every rank computes the tail), halos forward and back, all-gathers
    forward with an all-reduce of their gradient back, sums over tiles, batch-norm statistics
    (two small collectives per layer) and the weight-gradient all-reduce in buckets
    (``gradient_bytes``: each parameter's, the last registered first)."""
    link, ranks = cluster.link, grid.size
    compute = max(rank_compute_seconds(ops, cluster, rank) for rank in range(ranks))
    halo = sum(2 * exchange_seconds(op.transfers, list(op.transfer_bytes), link) for op in ops)
    gather = 0.0
    collective = 0.0
    for op in ops:
        if op.gathered_bytes:
            received = op.gathered_bytes * (ranks - 1) / ranks
            wire = received * (ranks if link.shared_medium else 1)
            gather += wire / link.bandwidth_bytes_per_second + (ranks - 1) * link.latency_seconds
            gather += allreduce_seconds(op.gathered_bytes, ranks, link)
        if op.summed_bytes:
            collective += 2 * allreduce_seconds(op.summed_bytes, ranks, link)
        if op.batchnorm_bytes:
            collective += small_collective_seconds(3 * op.batchnorm_bytes, ranks, link)
            collective += small_collective_seconds(2 * op.batchnorm_bytes, ranks, link)
    return FrontCost(
        cut,
        compute,
        halo,
        gather,
        collective,
        weight_sync_seconds(gradient_bytes, ranks, link),
        2 * sum(sum(op.transfer_bytes) for op in ops),
        sum(op.gathered_bytes for op in ops),
    )


def rank_compute_seconds(ops: tuple[FrontOp, ...], cluster: Cluster, rank: int) -> float:
    """Seconds ``rank`` computes per step (forward and backward) on its own board: its tile's
    share of every tiled operation and the whole of every other."""
    macs = sum(op.macs * (op.tile_fractions[rank] if op.tile_fractions else 1.0) for op in ops)
    return macs * (1.0 + cluster.device.backward_factor) / cluster.macs_per_second(rank)


def halo_bytes_sent(ops: tuple[FrontOp, ...], rank: int) -> int:
    """Bytes ``rank`` sends in halos per step: its forward halos and the gradient halos of what
    it received."""
    total = 0
    for op in ops:
        for transfer, size in zip(op.transfers, op.transfer_bytes, strict=True):
            if rank in (transfer.src, transfer.dst):
                total += size
    return total
