"""One way to show results: a rich table for people, or the same data as JSON with ``--json``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from edgetrain.errors import InvalidInput

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


def save_figure(fig: Any, out: str) -> None:
    """Write a matplotlib figure to ``out`` atomically (a temporary file beside it, then a
    rename), in the format its suffix names; one line for a path that cannot be written."""
    import matplotlib.pyplot as plt

    target = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, format=target.suffix.lstrip(".").lower())
        os.replace(tmp, target)
    except OSError as exc:
        raise InvalidInput(f"cannot write {out!r} ({exc.strerror}); pick another path") from exc
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)
