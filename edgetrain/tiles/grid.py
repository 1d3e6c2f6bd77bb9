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


@dataclass(frozen=True)
class Grid:
    """``rows`` × ``cols`` tiles; rank ``r`` is tile ``(r // cols, r % cols)``."""

    rows: int
    cols: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.cols < 1:
            raise InvalidInput(f"grid {self.rows}x{self.cols} is empty; use e.g. 2x2")

    @property
    def size(self) -> int:
        """Number of tiles, which is the number of ranks."""
        return self.rows * self.cols

    def position(self, rank: int) -> tuple[int, int]:
        """``(row, column)`` of ``rank``'s tile."""
        return divmod(rank, self.cols)

    def __str__(self) -> str:
        return f"{self.rows}x{self.cols}"


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
