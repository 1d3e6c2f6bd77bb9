"""The tiling a user asks for, pure (no torch): the grid of tiles, the image size and the
groups of fused layers, each read from the text a command line or a job gives, checked, and
written back (``"2x2"``, ``"480x640"``, ``"0-3,4-7,8"``).

:mod:`~edgetrain.tiles.tiling` plans the tiles' geometry for them and
:mod:`~edgetrain.tiles.grouping` chooses the groups (``"auto"``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from edgetrain.errors import InvalidInput

Grouping = tuple[tuple[int, int], ...]
"""Consecutive layer groups as inclusive ``(first, last)`` layer indices covering every layer."""


Span = tuple[int, int]
"""A half-open range of pixel indices ``[start, stop)`` along one axis."""


@dataclass(frozen=True)
class Grid:
    """``rows`` × ``cols`` tiles; rank ``r`` is tile ``(r // cols, r % cols)``.

    ``row_shares`` and ``col_shares`` (empty: equal tiles) are the fraction of every map's height
    each grid row takes and of its width each grid column takes, for boards that differ in speed
    or memory (see :func:`split`).
    """

    rows: int
    cols: int
    row_shares: tuple[float, ...] = ()
    col_shares: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rows < 1 or self.cols < 1:
            raise InvalidInput(f"grid {self.rows}x{self.cols} is empty; use e.g. 2x2")
        for name, shares, parts in (
            ("row", self.row_shares, self.rows),
            ("column", self.col_shares, self.cols),
        ):
            if shares and (len(shares) != parts or not all(s > 0 for s in shares)):
                raise InvalidInput(
                    f"grid {self.rows}x{self.cols} needs {parts} positive {name} shares, got "
                    f"{list(shares)}; give one per grid {name}"
                )

    def row_spans(self, size: int) -> tuple[Span, ...]:
        """The grid rows' spans of a map ``size`` pixels high."""
        return split(size, self.rows, self.row_shares)

    def col_spans(self, size: int) -> tuple[Span, ...]:
        """The grid columns' spans of a map ``size`` pixels wide."""
        return split(size, self.cols, self.col_shares)

    @property
    def equal(self) -> bool:
        """Whether every tile takes an equal share (the last row and column the remainder)."""
        return not self.row_shares and not self.col_shares

    def with_shares(self, rows: Sequence[float], cols: Sequence[float]) -> Grid:
        """This grid with the row and column shares given (normalised to sum 1)."""
        return Grid(self.rows, self.cols, _normalised(rows), _normalised(cols))

    @property
    def size(self) -> int:
        """Number of tiles, which is the number of ranks."""
        return self.rows * self.cols

    def position(self, rank: int) -> tuple[int, int]:
        """``(row, column)`` of ``rank``'s tile."""
        return divmod(rank, self.cols)

    def __str__(self) -> str:
        return f"{self.rows}x{self.cols}"

    def describe(self) -> str:
        """``2x2`` or, with shares, ``2x2 (rows 0.62/0.38, cols 0.50/0.50)``."""
        if self.equal:
            return str(self)
        rows = "/".join(f"{s:.2f}" for s in self.row_shares or _normalised([1.0] * self.rows))
        cols = "/".join(f"{s:.2f}" for s in self.col_shares or _normalised([1.0] * self.cols))
        return f"{self} (rows {rows}, cols {cols})"


def _normalised(shares: Sequence[float]) -> tuple[float, ...]:
    total = float(sum(shares))
    return tuple(float(s) / total for s in shares)


def split(size: int, parts: int, shares: Sequence[float] = ()) -> tuple[Span, ...]:
    """Cut ``size`` pixels into ``parts`` spans.

    With no ``shares``: spans of ``size // parts``, the last taking the rest. With shares (one
    positive number per part), span ``k`` ends at ``round(size * (s_0 + ... + s_k) / total)``,
    kept at least one pixel long, so a map's tiles follow the shares as closely as whole pixels
    allow and every map of one size is cut the same way.
    """
    step = size // parts
    if step == 0:
        raise InvalidInput(f"cannot cut {size} pixels into {parts} tiles; use at most {size}")
    if not shares:
        return tuple((i * step, size if i == parts - 1 else (i + 1) * step) for i in range(parts))
    total, running = float(sum(shares)), 0.0
    ends: list[int] = []
    for k in range(parts - 1):
        running += shares[k]
        end = round(size * running / total)
        low = (ends[-1] if ends else 0) + 1
        ends.append(min(max(end, low), size - (parts - 1 - k)))
    starts = [0, *ends]
    return tuple(zip(starts, [*ends, size], strict=True))


_GRID = re.compile(r"^\s*(\d+)\s*[xX×*]\s*(\d+)\s*$")


def parse_grid(text: str) -> Grid:
    """``"2x2"`` → ``Grid(2, 2)`` (rows × columns)."""
    match = _GRID.match(text)
    if match is None:
        raise InvalidInput(f"cannot read grid {text!r}; write rows x columns, e.g. 2x2 or 1x3")
    return Grid(int(match.group(1)), int(match.group(2)))


_IMAGE = re.compile(r"^\s*(\d+)\s*(?:[xX×*]\s*(\d+)\s*)?$")


def parse_image(text: str) -> tuple[int, int]:
    """``"416"`` → ``(416, 416)``; ``"480x640"`` → ``(480, 640)`` (height × width, pixels)."""
    match = _IMAGE.match(text)
    if match is None:
        raise InvalidInput(
            f"cannot read image size {text!r}; write one number (416) or height x width (480x640)"
        )
    height = int(match.group(1))
    width = int(match.group(2)) if match.group(2) is not None else height
    if height < 1 or width < 1:
        raise InvalidInput(f"image {height}x{width} is empty; use a positive size, e.g. 416")
    return height, width


def parse_groups(text: str, layers: int) -> Grouping:
    """Read ``"per-layer"``, ``"1"`` (one group), ``"3"`` (three even groups) or ``"0-3,4-7,8"``.

    ``"auto"`` is not handled here: it needs the cost model (see
    :func:`edgetrain.tiles.grouping.optimise`).
    """
    spec = text.strip().lower()
    if spec in ("per-layer", "per_layer", "layer", "each"):
        return tuple((i, i) for i in range(layers))
    if spec.isdigit():
        count = int(spec)
        if not 1 <= count <= layers:
            raise InvalidInput(f"cannot make {count} groups of {layers} layers; use 1..{layers}")
        cuts = [round(i * layers / count) for i in range(count + 1)]
        return tuple((cuts[i], cuts[i + 1] - 1) for i in range(count))
    groups: list[tuple[int, int]] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise InvalidInput(
                f"cannot read groups {text!r}; write auto, per-layer, 1 or ranges like 0-3,4-7,8-15"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        groups.append((first, last))
    return check_grouping(tuple(groups), layers)


def check_grouping(groups: Grouping, layers: int) -> Grouping:
    """Raise InvalidInput unless ``groups`` are consecutive and cover layers ``0..layers-1``."""
    expected = 0
    for first, last in groups:
        if first != expected or last < first:
            raise InvalidInput(
                f"groups {format_grouping(groups)} must be consecutive ranges starting at 0 "
                f"(expected one starting at {expected}); e.g. 0-3,4-{layers - 1}"
            )
        expected = last + 1
    if expected != layers:
        raise InvalidInput(
            f"groups {format_grouping(groups)} cover layers 0-{expected - 1} but the network "
            f"has {layers}; end the last group at {layers - 1}"
        )
    return groups


def format_grouping(groups: Sequence[tuple[int, int]]) -> str:
    """``((0, 3), (4, 4))`` → ``"0-3,4"``."""
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in groups)
