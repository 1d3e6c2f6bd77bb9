"""The cost model's compute seconds of every rank of a model on a grid with shares, and a job's
tiles balanced for boards that differ (torch: a graph model is captured to be priced)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from edgetrain.devices.cluster import Cluster
from edgetrain.tiles.balance import balance, speed_shares


def rank_seconds(
    model: Any,
    image: Any,
    grid: Any,
    batch: int,
    spec: tuple[str, str],
    dtype: str,
    chain: bool,
    cluster: Cluster,
) -> tuple[Callable[[Cluster], Any], str]:
    """A function of a cluster giving the cost model's per-rank compute seconds on a grid, with
    the grouping or cut (``spec``: groups, cut) fixed to what ``cluster``'s cost model picks on
    ``grid``; and that choice as text."""
    groups, cut = spec
    dtypes = {"float32": torch.float32, "float64": torch.float64}

    if chain:
        from edgetrain.tiles.grid import format_grouping
        from edgetrain.tiles.grouping import choose_grouping, rank_compute_seconds
        from edgetrain.tiles.layers import describe
        from edgetrain.tiles.tiling import plan

        net = describe(model, 3, *image)
        net.check_batch(batch)
        element = dtypes[dtype].itemsize
        grouping = choose_grouping(groups, net, grid, cluster, batch, element)

        def chain_seconds(cluster: Cluster) -> Any:
            return lambda g: rank_compute_seconds(plan(net, g, grouping), cluster, batch)

        return chain_seconds, format_grouping(grouping)
    from edgetrain.tiles.front import rank_compute_seconds as front_seconds
    from edgetrain.tiles.graph import analyse, choose_cut, front_ops, place

    channels = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d)).in_channels
    sample = torch.zeros(batch, channels, *image, dtype=dtypes[dtype])
    graph, infos = analyse(model.to(dtypes[dtype]), sample)
    if cut == "auto":
        index = choose_cut(graph, infos, grid, cluster)[0].cut
    else:
        index = len(infos) if cut == "last" else int(cut)

    def graph_seconds(cluster: Cluster) -> Any:
        def seconds(g: Any) -> Any:
            ops = front_ops(infos, place(graph, infos, g, index))
            return [front_seconds(ops, cluster, r) for r in range(g.size)]

        return seconds

    return graph_seconds, str(index)


def balanced_job(job: Any, cluster: Cluster) -> Any:
    """``job`` (a :class:`~edgetrain.tiles.worker.TileJob` on equal tiles) with its grid's shares
    balanced for ``cluster``'s boards by the cost model (:func:`~edgetrain.tiles.balance.balance`),
    its grouping or cut kept; the memory check is :func:`~edgetrain.tiles.boards.fit_boards`'."""
    from edgetrain.tiles.grid import format_grouping

    chain = job.cut is None
    spec = (format_grouping(job.grouping), "auto") if chain else ("auto", str(job.cut))
    speeds = [b.macs_per_second for b in cluster.boards]
    speed_shares(job.grid, speeds)  # refuses a profile whose board count is not the grid's
    seconds_for, _ = rank_seconds(
        job.model, job.image, job.grid, job.batch, spec, job.dtype, chain, cluster
    )
    shares = balance(job.grid, speeds, seconds_for(cluster), max(job.image))
    return replace(job, grid=shares)
