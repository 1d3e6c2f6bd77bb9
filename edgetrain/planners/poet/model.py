"""The MILP as arrays: columns and rows collected in order, and the columns of POET's matrices.

:class:`MilpModel` collects bounds, costs, integrality and row entries as plain lists that
:func:`edgetrain.planners.poet.highs.run` passes to HiGHS in one call; :class:`Variables` says
which column holds each entry of the five ``T × T`` matrices (``-1``: no column, the entry is 0).
:func:`plan_from` reads a solution back into matrices and :func:`start_from` writes a plan as a
MIP start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class MilpModel:
    """Columns and rows collected as arrays, then passed to HiGHS in one call."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.starts: list[int] = [0]
        self.index: list[int] = []
        self.value: list[float] = []

    def col(self, lower: float, upper: float, *, integer: bool, cost: float = 0.0) -> int:
        """Add a column; returns its index."""
        self.lower.append(lower)
        self.upper.append(upper)
        self.cost.append(cost)
        self.integer.append(1 if integer else 0)
        return len(self.lower) - 1

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        """Add ``lower ≤ Σ coef · column ≤ upper``; terms of column ``-1`` (no column) are
        dropped, terms of one column are summed and zero sums dropped."""
        merged: dict[int, float] = {}
        for col, coef in terms:
            if col >= 0:
                merged[col] = merged.get(col, 0.0) + coef
        for col, coef in merged.items():
            if coef != 0.0:
                self.index.append(col)
                self.value.append(coef)
        self.starts.append(len(self.index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    @property
    def num_cols(self) -> int:
        return len(self.lower)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)


@dataclass(frozen=True)
class Variables:
    """The column of each entry of the five ``T × T`` matrices (``-1``: none, fixed at 0).

    Attributes:
        r / s_ram / s_flash / page_in / page_out: column indices (int arrays).
        budget: column of the RAM budget when it is a variable, else -1.
    """

    r: np.ndarray
    s_ram: np.ndarray
    s_flash: np.ndarray
    page_in: np.ndarray
    page_out: np.ndarray
    budget: int


def start_from(plan: dict[str, np.ndarray], v: Variables) -> tuple[np.ndarray, np.ndarray]:
    """The integer columns of ``plan`` as (column indices, values) for a MIP start."""
    cols: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for key, index in (
        ("R", v.r),
        ("S_ram", v.s_ram),
        ("S_flash", v.s_flash),
        ("page_in", v.page_in),
        ("page_out", v.page_out),
    ):
        mask = index >= 0
        matrix = np.asarray(plan[key])
        if key == "page_out":
            # The model pages a node out at most once (a second page-out only costs energy) ...
            first = np.cumsum(matrix, axis=0)
            matrix = np.where((matrix > 0) & (first == 1), 1, 0)
        if key == "S_flash":
            # ... and keeps it on flash from then on (free): S_flash[t+1] = S_flash[t] + out[t].
            out = np.cumsum(np.asarray(plan["page_out"]), axis=0) > 0
            matrix = np.zeros_like(matrix)
            matrix[1:] = out[:-1]
        cols.append(index[mask])
        values.append(matrix[mask].astype(np.float64))
    return np.concatenate(cols), np.concatenate(values)


def plan_from(values: np.ndarray, v: Variables) -> dict[str, np.ndarray]:
    """The five 0/1 matrices of a solution's column ``values``."""

    def matrix(cols: np.ndarray) -> np.ndarray:
        out = np.zeros(cols.shape, dtype=np.int64)
        mask = cols >= 0
        out[mask] = np.rint(values[cols[mask]]).astype(np.int64)
        return out

    return {
        "R": matrix(v.r),
        "S_ram": matrix(v.s_ram),
        "S_flash": matrix(v.s_flash),
        "page_in": matrix(v.page_in),
        "page_out": matrix(v.page_out),
    }
