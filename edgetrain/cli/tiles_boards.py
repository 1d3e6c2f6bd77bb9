"""``edgetrain tiles --device FILE`` with a file of boards that differ: the job fitted by
:func:`edgetrain.tiles.boards.fit_boards` and its report."""

from __future__ import annotations

from typing import Any

from edgetrain.devices.cluster import Cluster
from edgetrain.errors import InvalidInput
from edgetrain.units import format_bytes


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
    members: tuple[int, ...] | None = None,
) -> tuple[Any, dict[str, Any], Any]:
    """The job, its report and its :class:`~edgetrain.tiles.boards.BoardFit` for ``cluster``'s
    boards on ``grid``: shares balanced by speed, every rank within its board's memory.
    ``members`` are the boards' places in the profile (by default their ranks: the boards that
    remain after others dropped out keep theirs). InvalidInput when the profile does not match
    the grid or a board cannot fit."""
    from edgetrain.tiles.boardcost import rank_seconds
    from edgetrain.tiles.boards import fit_boards, start_shares

    if memory is not None:
        raise InvalidInput(
            "give --memory (boards alike) or a --device file of boards (each board's memory in "
            "the file), not both"
        )
    start = start_shares(grid, cluster)
    seconds_for, choice = rank_seconds(
        model, image, start, batch, (groups, cut), dtype, chain, cluster
    )
    places = members or tuple(range(len(cluster.boards)))
    fit = fit_boards(
        grid,
        cluster,
        max(image),
        seconds_for,
        lambda g: setup(model, image, g, batch, choice, choice, cluster, dtype),
        places,
    )
    doc = fit.extra
    doc["boards"] = _rows(cluster, fit, places)
    shares = fit.job.grid
    doc["shares"] = {"rows": list(shares.row_shares), "cols": list(shares.col_shares)}
    return fit.job, doc, fit


def _rows(cluster: Cluster, fit: Any, members: tuple[int, ...]) -> list[dict[str, Any]]:
    return [
        {
            "rank": m.rank,
            "profile_board": members[m.rank],
            "board": cluster.board(m.rank).name,
            "macs_per_second": cluster.macs_per_second(m.rank),
            "memory_bytes": cluster.board(m.rank).memory_bytes,
            "predicted_board_peak_bytes": m.tensor_peak_bytes,
            "kernel_scratch_bytes": m.scratch_bytes,
            "predicted_board_heap_bytes": m.peak_bytes,
            "predicted_compute_seconds": fit.compute_seconds[m.rank],
        }
        for m in fit.ranks
    ]


def boards_report(doc: dict[str, Any], results: Any, fitted: Any) -> bool:
    """With boards that differ (``fitted`` not None), adds each rank's measured peak (weights
    included) to ``doc``'s boards; True when a board went over its memory."""
    over = False
    if fitted is None:
        return over
    from edgetrain.tiles.budget import measured_beside, over_budget

    for row, result in zip(doc["boards"], results, strict=True):
        row.update(measured_beside(fitted.ranks[result.rank], result))
        over = over or over_budget(row, row["memory_bytes"])
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
            f"\nboard {row['profile_board']} ({row['board']}, {row['macs_per_second']:.3g} MAC/s): "
            f"compute {row['predicted_compute_seconds']:.3f} s/step predicted, peak "
            f"{format_bytes(row['predicted_board_heap_bytes'])} predicted with the kernels' "
            "scratch"
            + (f", tensors {format_bytes(measured)} measured" if measured is not None else "")
            + f" of {format_bytes(row['memory_bytes'])}"
        )
    return lines
