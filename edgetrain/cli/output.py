"""One way to show results: a rich table for people, or the same data as JSON with ``--json``."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()
if not console.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    console = Console(width=160)


def emit_json(data: Any) -> None:
    """Print ``data`` as one JSON document on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, caption: str | None = None
) -> Table:
    """A rich table with right-aligned columns after the first."""
    out = Table(title=title, caption=caption, caption_justify="left")
    for i, column in enumerate(columns):
        out.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*(cell if isinstance(cell, str) else str(cell) for cell in row))
    return out
