"""Helpers shared by the benchmarks: interleaved timing with medians, and table/JSON output."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def interleaved_medians(
    steps: dict[str, Callable[[], object]], rounds: int, warmup: int = 1
) -> dict[str, float]:
    """Median wall time of each step, measured round-robin so drift hits every one alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def interleaved_cpu_wall(
    steps: dict[str, Callable[[], object]], rounds: int, warmup: int = 1
) -> dict[str, tuple[float, float]]:
    """Median (process CPU seconds, wall seconds) of each step, measured round-robin.

    Process CPU time (``time.process_time``: every thread of this process, nothing of other
    processes) is what to judge on a shared machine when torch runs one thread: other jobs
    stretch the wall clock of a step, not the CPU time it takes.
    """
    for _ in range(warmup):
        for step in steps.values():
            step()
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    wall: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            step()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start_wall)
    return {name: (statistics.median(cpu[name]), statistics.median(wall[name])) for name in steps}


def emit(
    title: str,
    columns: Sequence[str],
    rows: Sequence[dict[str, Any]],
    as_json: bool,
    extra: dict[str, Any] | None = None,
) -> None:
    """Print rows as a rich table (or JSON with ``extra`` fields)."""
    if as_json:
        print(json.dumps({"title": title, "rows": list(rows), **(extra or {})}, indent=2))
        return
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(_cell(row.get(c)) for c in columns))
    console = Console(width=200)
    console.print(table)
    for key, value in (extra or {}).items():
        console.print(f"{key}: {value}")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
