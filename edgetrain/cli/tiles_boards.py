"""``edgetrain tiles --profile FILE``: tiles sized for boards that differ in speed and memory.

The grid's row and column shares start from the boards' speeds and are moved while the cost
model's slowest rank gets faster (:func:`edgetrain.tiles.balance.balance`); every rank's peak is
then predicted by running its step (:func:`edgetrain.tiles.budget.predict_ranks`). A rank over
its board's memory is balanced again as if its board were slower, in proportion to how far over
it is, until every rank fits; else one line names the board and what it would need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from edgetrain.devices.cluster import Cluster
from edgetrain.errors import InvalidInput
from edgetrain.units import format_bytes

ATTEMPTS = 8
"""Times the shares are balanced again for ranks over their board's memory."""


def _rank_seconds(
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
    from edgetrain.tiles.worker import DTYPES

    if chain:
        from edgetrain.tiles.grid import format_grouping
        from edgetrain.tiles.grouping import choose_grouping, rank_compute_seconds
        from edgetrain.tiles.layers import describe
        from edgetrain.tiles.tiling import plan

        net = describe(model, 3, *image)
        net.check_batch(batch)
        element = DTYPES[dtype].itemsize
        grouping = choose_grouping(groups, net, grid, cluster, batch, element)

        def chain_seconds(cluster: Cluster) -> Any:
            return lambda g: rank_compute_seconds(plan(net, g, grouping), cluster, batch)

        return chain_seconds, format_grouping(grouping)
    import torch

    from edgetrain.tiles.front import rank_compute_seconds as front_seconds
    from edgetrain.tiles.graph import analyse, choose_cut, front_ops, place

    channels = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d)).in_channels
    sample = torch.zeros(batch, channels, *image, dtype=DTYPES[dtype])
    graph, infos = analyse(model.to(DTYPES[dtype]), sample)
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


def _slower(cluster: Cluster, factors: list[float]) -> Cluster:
    """``cluster`` with board ``r``'s speed multiplied by ``factors[r]``."""
    boards = tuple(
        replace(b, core_macs_per_second=b.core_macs_per_second * f)
        for b, f in zip(cluster.boards, factors, strict=True)
    )
    return replace(cluster, boards=boards)


def fit_profile(
    model: Any,
    image: Any,
    grid: Any,
    batch: int,
    groups: str,
    cut: str,
    cluster: Cluster,
    dtype: str,
    setup: Any,
    chain: bool,
    memory: int | None = None,
) -> tuple[Any, dict[str, Any], Any]:
    """The job, its report and its :class:`~edgetrain.tiles.budget.Fitted` memory for
    ``cluster``'s boards on ``grid``: shares balanced by speed, every rank within its board's
    memory. InvalidInput when the profile does not match the grid or a board cannot fit."""
    from edgetrain.tiles.balance import balance, speed_shares
    from edgetrain.tiles.budget import Candidate, Fitted, predict_ranks

    if memory is not None:
        raise InvalidInput(
            "give --memory (boards alike) or a --device file of boards (each board's memory in "
            "the file), not both"
        )
    speeds = [b.macs_per_second for b in cluster.boards]
    start = speed_shares(grid, speeds)
    seconds_for, choice = _rank_seconds(
        model, image, start, batch, (groups, cut), dtype, chain, cluster
    )
    factors = [1.0] * grid.size
    resolution = max(image)
    for _ in range(ATTEMPTS):
        slower = _slower(cluster, factors)
        shares = balance(
            grid, [b.macs_per_second for b in slower.boards], seconds_for(slower), resolution
        )
        job, doc = setup(model, image, shares, batch, choice, choice, cluster, dtype)
        ranks = predict_ranks(job)
        over = [m for m in ranks if m.peak_bytes > cluster.board(m.rank).memory_bytes]
        if not over:
            fitted = Fitted(
                Candidate(job, doc["predicted_seconds"]["step_seconds"], "", doc), ranks
            )
            doc["boards"] = _rows(cluster, ranks, seconds_for(cluster)(shares))
            doc["shares"] = {"rows": list(shares.row_shares), "cols": list(shares.col_shares)}
            return job, doc, fitted
        for memory in over:
            board = cluster.board(memory.rank)
            if memory.held_bytes >= board.memory_bytes:
                raise InvalidInput(
                    f"board {memory.rank} ({board.name}) has {format_bytes(board.memory_bytes)} "
                    f"but the model's weights and buffers alone take "
                    f"{format_bytes(memory.held_bytes)}; give it more memory or leave it out"
                )
            room = (board.memory_bytes - memory.held_bytes) / memory.step_peak_bytes
            factors[memory.rank] *= max(0.25, 0.95 * room)
    worst = max(over, key=lambda m: m.peak_bytes / cluster.board(m.rank).memory_bytes)
    board = cluster.board(worst.rank)
    raise InvalidInput(
        f"board {worst.rank} ({board.name}) has {format_bytes(board.memory_bytes)} but its "
        f"smallest tile found needs {format_bytes(worst.peak_bytes)} ({worst.peak_bytes:,} "
        f"bytes); give it more memory in the profile, a larger grid or a smaller image or batch"
    )


def _rows(cluster: Cluster, ranks: Any, seconds: Any) -> list[dict[str, Any]]:
    return [
        {
            "rank": m.rank,
            "board": cluster.board(m.rank).name,
            "macs_per_second": cluster.macs_per_second(m.rank),
            "memory_bytes": cluster.board(m.rank).memory_bytes,
            "predicted_peak_bytes": m.peak_bytes,
            "predicted_compute_seconds": seconds[m.rank],
        }
        for m in ranks
    ]


def boards_report(doc: dict[str, Any], results: Any, fitted: Any) -> bool:
    """With boards that differ (``fitted`` not None), adds each rank's measured peak (weights
    included) to ``doc``'s boards; True when a board went over its memory."""
    over = False
    if fitted is None or doc["recoveries"]:
        return over
    for row, result in zip(doc["boards"], results, strict=True):
        row["board_peak_bytes"] = fitted.ranks[result.rank].held_bytes + result.peak_bytes
        over = over or row["board_peak_bytes"] > row["memory_bytes"]
    return over


def caption_lines(doc: dict[str, Any]) -> str:
    """One line per board: its share of the work, predicted compute, and memory."""
    shares = doc["shares"]
    lines = "\ntile shares: rows {}, columns {}".format(
        "/".join(f"{x:.3f}" for x in shares["rows"]), "/".join(f"{x:.3f}" for x in shares["cols"])
    )
    for row in doc["boards"]:
        measured = row.get("board_peak_bytes")
        lines += (
            f"\nboard {row['rank']} ({row['board']}, {row['macs_per_second']:.3g} MAC/s): "
            f"compute {row['predicted_compute_seconds']:.3f} s/step predicted, peak "
            f"{format_bytes(row['predicted_peak_bytes'])} predicted"
            + (f", {format_bytes(measured)} measured" if measured is not None else "")
            + f" of {format_bytes(row['memory_bytes'])}"
        )
    return lines
