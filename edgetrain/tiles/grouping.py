"""Layer grouping: a cost model of one tile-parallel training step and the best grouping (pure).

Fusing many layers into one group saves communication (one halo exchange per group, at its
input) but costs redundant computation (the halo grows with every window it is traced through).
The cost model prices a group as

* compute: the slowest rank's multiply-accumulates (halo included) × (1 + backward factor) /
  its board's rate (``Device.macs_per_second``; boards that differ each have their own);
* halo: forward halos plus the same bytes back as gradient halos. On a switch every device has its
  own full-duplex link, so an exchange takes the largest bytes any rank sends or receives over
  the bandwidth; on a shared medium (Wi-Fi) all transfers queue on one channel. Each message adds
  the link latency;
* batch norm: two small collectives per batch-norm layer (statistics forward, gradient sums
  backward), each ``ceil(log2 P)`` latencies plus its bytes. A group's last layer's batch norm
  travels with the next group's halo exchange (:mod:`edgetrain.tiles.halonorm`): only its bytes
  count, not its latencies.

The step adds the all-reduce of the weight gradients (ring: ``2 (P-1)/P`` of the gradient bytes
per device, ``2 (P-1)`` latencies per bucket of :func:`gradient_buckets`), which does not depend
on the grouping. Because a group's cost depends only on its
own first and last layer (its input is always cut by the same grid), the total is a sum over
groups and a dynamic program over group boundaries finds the cheapest grouping in ``O(L^2)``
group evaluations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil, log2

from edgetrain.devices.cluster import Cluster, Link
from edgetrain.tiles.grid import Grid, Grouping, check_grouping, parse_groups
from edgetrain.tiles.tiling import GroupPlan, Network, TilePlan, Transfer, plan_group


@dataclass(frozen=True)
class GroupCost:
    """Predicted seconds of one group in one training step (forward + backward)."""

    first: int
    last: int
    compute_seconds: float
    halo_seconds: float
    batchnorm_seconds: float
    halo_bytes: int
    """Bytes of forward halos plus backward gradient halos, summed over all ranks."""
    macs: int
    """Forward multiply-accumulates over all ranks, halo recomputation included."""

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.halo_seconds + self.batchnorm_seconds


@dataclass(frozen=True)
class StepCost:
    """Predicted time of one training step of a grouping on a cluster.

    ``untiled_macs`` is the network's forward work without any halo, so
    ``macs / untiled_macs - 1`` is the redundant computation.
    """

    grouping: Grouping
    groups: tuple[GroupCost, ...]
    allreduce_seconds: float
    untiled_macs: int

    @property
    def seconds(self) -> float:
        """Predicted seconds per training step."""
        return sum(g.seconds for g in self.groups) + self.allreduce_seconds

    @property
    def compute_seconds(self) -> float:
        return sum(g.compute_seconds for g in self.groups)

    @property
    def communication_seconds(self) -> float:
        """Halo exchanges, batch-norm collectives and the weight-gradient all-reduce."""
        return self.seconds - self.compute_seconds

    @property
    def halo_bytes(self) -> int:
        return sum(g.halo_bytes for g in self.groups)

    @property
    def macs(self) -> int:
        return sum(g.macs for g in self.groups)

    @property
    def redundancy(self) -> float:
        """Forward work over the untiled network's (1.0 = no recomputation)."""
        return self.macs / self.untiled_macs if self.untiled_macs else 1.0


def exchange_seconds(transfers: tuple[Transfer, ...], bytes_of: list[int], link: Link) -> float:
    """Seconds for one exchange in which ``transfers[i]`` carries ``bytes_of[i]`` bytes."""
    if not transfers:
        return 0.0
    ranks = 1 + max(max(t.src, t.dst) for t in transfers)
    sent, received, messages = [0] * ranks, [0] * ranks, [0] * ranks
    for transfer, size in zip(transfers, bytes_of, strict=True):
        sent[transfer.src] += size
        received[transfer.dst] += size
        messages[transfer.src] += 1
    if link.shared_medium:
        return (
            sum(bytes_of) / link.bandwidth_bytes_per_second + len(transfers) * link.latency_seconds
        )
    busiest = max(max(s, r) for s, r in zip(sent, received, strict=True))
    return busiest / link.bandwidth_bytes_per_second + max(messages) * link.latency_seconds


def allreduce_seconds(size_bytes: int, ranks: int, link: Link) -> float:
    """A ring all-reduce of ``size_bytes`` on every rank: ``2 (P-1)`` steps of ``1/P`` each."""
    if ranks <= 1:
        return 0.0
    per_rank = 2 * (ranks - 1) / ranks * size_bytes
    wire = per_rank * ranks if link.shared_medium else per_rank
    return wire / link.bandwidth_bytes_per_second + 2 * (ranks - 1) * link.latency_seconds


GRADIENT_BUCKET_BYTES = 1 << 20
"""Consecutive gradients are summed together in one all-reduce (a bucket) of at most this many
bytes: each collective costs latencies, and a bucket starts as soon as its last gradient is
ready, so it still overlaps the backward pass of the earlier layers. A larger gradient is a
bucket of its own, summed where it lies (a bucket of several is copied into one buffer)."""


def gradient_buckets(
    unit_bytes: Sequence[int], cap_bytes: int = GRADIENT_BUCKET_BYTES
) -> tuple[tuple[int, ...], ...]:
    """Indices of ``unit_bytes`` (gradients in the order backward produces them: the last
    registered first) in consecutive buckets of at most ``cap_bytes``; a larger one is a bucket
    of its own; empty ones belong to no bucket."""
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    for index, nbytes in enumerate(unit_bytes):
        if nbytes <= 0:
            continue
        if current and size + nbytes > cap_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


def weight_sync_seconds(unit_bytes: Sequence[int], ranks: int, link: Link) -> float:
    """The weight-gradient all-reduce: one ring all-reduce per bucket of
    :func:`gradient_buckets`."""
    return sum(
        allreduce_seconds(sum(unit_bytes[i] for i in bucket), ranks, link)
        for bucket in gradient_buckets(unit_bytes)
    )


def gradient_bytes(net: Network, element_bytes: int) -> tuple[int, ...]:
    """Bytes of each trainable tensor's gradient, the last registered first (the order backward
    produces them): what :class:`~edgetrain.tiles.sync.GradientSync` buckets."""
    sizes = []
    for layer in reversed(net.layers):
        tensors = layer.parameter_tensors or ((layer.parameters,) if layer.parameters else ())
        sizes += [n * element_bytes for n in reversed(tensors)]
    return tuple(sizes)


def small_collective_seconds(
    size_bytes: int, ranks: int, link: Link, latency: bool = True
) -> float:
    """A latency-bound collective (tree): ``ceil(log2 P)`` rounds of ``size_bytes``; without
    ``latency`` only the bytes (they ride on messages that are sent anyway)."""
    if ranks <= 1:
        return 0.0
    rounds = ceil(log2(ranks))
    wire = size_bytes * (ranks if link.shared_medium else 1)
    return rounds * (latency * link.latency_seconds + wire / link.bandwidth_bytes_per_second)


def group_cost(
    net: Network,
    group: GroupPlan,
    cluster: Cluster,
    batch: int,
    element_bytes: int,
    followed: bool = False,
) -> GroupCost:
    """Predicted cost of one group (see the module docstring); ``followed``: another group comes
    after it, whose halo exchange carries this group's last batch norm's messages."""
    ranks = group.grid.size
    device, link = cluster.device, cluster.link
    per_rank = [
        sum(
            net.layers[index].macs_per_pixel * group.computed(j + 1, rank).area
            for j, index in enumerate(group.layers)
        )
        * batch
        for rank in range(ranks)
    ]
    compute = max(m / cluster.macs_per_second(r) for r, m in enumerate(per_rank)) * (
        1.0 + device.backward_factor
    )
    transfers = group.transfers()
    channels = net.layers[group.first].in_channels
    sizes = [t.region.area * channels * batch * element_bytes for t in transfers]
    halo = 2 * exchange_seconds(transfers, sizes, link)
    if group.first > 0 and net.layers[group.first - 1].batchnorm:
        # The previous layer's batch-norm rounds carry this exchange: at least their latencies.
        halo = max(halo, 2 * small_collective_seconds(0, ranks, link))
    batchnorm = 0.0
    for index in group.layers:
        layer = net.layers[index]
        if layer.batchnorm:
            alone = not (followed and index == group.last)
            # forward: all-gather of count, mean, M2; backward: all-reduce of two sums.
            for values in (3, 2):
                size = values * layer.out_channels * element_bytes
                batchnorm += small_collective_seconds(size, ranks, link, latency=alone)
    return GroupCost(
        group.first, group.last, compute, halo, batchnorm, 2 * sum(sizes), sum(per_rank)
    )


def step_cost(
    net: Network,
    grid: Grid,
    grouping: Grouping,
    cluster: Cluster,
    batch: int = 1,
    element_bytes: int = 4,
) -> StepCost:
    """Predicted cost of one training step of ``grouping`` (``grid.size`` devices)."""
    check_grouping(grouping, len(net.layers))
    groups = tuple(
        group_cost(
            net, plan_group(net, grid, a, b), cluster, batch, element_bytes, b < len(net.layers) - 1
        )
        for a, b in grouping
    )
    return StepCost(
        grouping,
        groups,
        weight_sync_seconds(gradient_bytes(net, element_bytes), grid.size, cluster.link),
        net.macs() * batch,
    )


def sync_points(net: Network, grid: Grid, grouping: Grouping, rank: int) -> int:
    """How often ``rank`` waits for its peers in one training step of a chain: two rounds per
    batch-norm layer (its statistics forward, its gradient sums backward), which also carry the
    next group's halos when the layer ends a group; two per other group boundary at which the
    rank sends or receives a halo (forward halo, gradient halo); and one at the end for the
    weight gradients and the loss."""
    if grid.size <= 1:
        return 0
    rounds = 2 * sum(layer.batchnorm for layer in net.layers) + 1
    for first, last in grouping[1:]:
        if net.layers[first - 1].batchnorm:
            continue
        transfers = plan_group(net, grid, first, last).transfers()
        if any(rank in (t.src, t.dst) for t in transfers):
            rounds += 2
    return rounds


def plan_cost(plan: TilePlan, cluster: Cluster, batch: int = 1, element_bytes: int = 4) -> StepCost:
    """:func:`step_cost` of an existing plan."""
    return step_cost(plan.network, plan.grid, plan.grouping, cluster, batch, element_bytes)


def rank_compute_seconds(plan: TilePlan, cluster: Cluster, batch: int = 1) -> tuple[float, ...]:
    """Seconds every rank computes per step (forward and backward, halo included) on its board."""
    factor = batch * (1.0 + cluster.device.backward_factor)
    return tuple(
        plan.macs(rank) * factor / cluster.macs_per_second(rank) for rank in range(plan.ranks)
    )


def optimise(
    net: Network,
    grid: Grid,
    cluster: Cluster,
    batch: int = 1,
    element_bytes: int = 4,
) -> StepCost:
    """The grouping with the least predicted step time (dynamic program over boundaries).

    ``best[j]`` is the cheapest way to run layers ``0..j-1``; a last group ``i..j-1`` extends
    ``best[i]``. Ties (within a relative 1e-9) go to fewer groups.
    """
    n = len(net.layers)
    cost: dict[tuple[int, int], GroupCost] = {}
    best: list[tuple[float, int, Grouping]] = [(0.0, 0, ())]
    for j in range(1, n + 1):
        options = []
        for i in range(j):
            key = (i, j - 1)
            if key not in cost:
                cost[key] = group_cost(
                    net, plan_group(net, grid, i, j - 1), cluster, batch, element_bytes, j < n
                )
            seconds, count, groups = best[i]
            options.append((seconds + cost[key].seconds, count + 1, (*groups, key)))
        least = min(o[0] for o in options)
        # Equal costs (within rounding) go to the grouping with fewer groups.
        best.append(min((o for o in options if o[0] <= least * (1 + 1e-9)), key=lambda o: o[1]))
    grouping = best[n][2]
    return StepCost(
        grouping,
        tuple(cost[g] for g in grouping),
        weight_sync_seconds(gradient_bytes(net, element_bytes), grid.size, cluster.link),
        net.macs() * batch,
    )


def single_core_seconds(net: Network, cluster: Cluster, batch: int = 1) -> float:
    """One training step of the untiled network on one core of one device (the paper's base)."""
    device = cluster.device
    return net.macs() * batch * (1.0 + device.backward_factor) / device.core_macs_per_second


GRIDS: dict[int, Grid] = {
    1: Grid(1, 1),
    2: Grid(1, 2),
    3: Grid(1, 3),
    4: Grid(2, 2),
    5: Grid(1, 5),
    6: Grid(2, 3),
    8: Grid(2, 4),
    9: Grid(3, 3),
}
"""The grid used for a given number of devices (as square as the count allows)."""


def grid_for(devices: int) -> Grid:
    """A grid of ``devices`` tiles, as square as possible (rows <= columns)."""
    if devices in GRIDS:
        return GRIDS[devices]
    rows = max(r for r in range(1, int(devices**0.5) + 1) if devices % r == 0)
    return Grid(rows, devices // rows)


def choose_grouping(
    spec: str,
    net: Network,
    grid: Grid,
    cluster: Cluster,
    batch: int = 1,
    element_bytes: int = 4,
) -> Grouping:
    """``"auto"``: the grouping :func:`optimise` finds for ``cluster``; else as written."""
    if spec.strip().lower() == "auto":
        return optimise(net, grid, cluster, batch, element_bytes).grouping
    grouping = parse_groups(spec, len(net.layers))
    for first, last in grouping:
        plan_group(net, grid, first, last)  # raises InvalidInput for a grid the maps cannot hold
    return grouping
