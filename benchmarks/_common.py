"""Helpers shared by the benchmarks: interleaved timing with medians, a step's tensor peak,
table/JSON output, and the record of where a result was measured."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from edgetrain.autograd.heap import HeapPeak
from edgetrain.autograd.scratch import allocator_peak
from edgetrain.autograd.storage_counter import StorageCounter


def step_peak_bytes(step: Callable[[], object]) -> int:
    """The tensor peak of one run of ``step`` (live storages, above what was held before)."""
    counter = StorageCounter()
    with counter:
        step()
    return counter.peak_bytes


def step_heap_bytes(step: Callable[[], object]) -> int:
    """The heap one run of ``step`` takes above what was in use before: its tensors and the
    kernels' scratch, the larger of torch's CPU allocator's record (every allocation and free
    in order, from the profiler) and glibc's ``mallinfo2`` sampled through a second run."""
    recorded, _ = allocator_peak(step)
    with HeapPeak() as heap:
        step()
    return max(recorded or 0, heap.peak_bytes or 0)


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


def interleaved_samples(
    steps: dict[str, Callable[[], object]], rounds: int, warmup: int = 1, seed: int = 0
) -> dict[str, list[tuple[float, float]]]:
    """(process CPU seconds, wall seconds) of every step in every round, round-robin, each
    round in an order of its own (shuffled with ``seed``), so that no step always runs first
    or right after the same neighbour.

    Process CPU time (``time.process_time``: every thread of this process, nothing of other
    processes) is what to judge on a shared machine when torch runs one thread: other jobs
    stretch the wall clock of a step, not the CPU time it takes. They still slow it: this
    machine's two vCPUs share their host, and steps timed minutes apart differ by up to 40 %,
    so compare steps of the same round (:func:`paired_ratio`).
    """
    for _ in range(warmup):
        for step in steps.values():
            step()
    order = list(steps)
    shuffle = random.Random(seed).shuffle
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            steps[name]()
            cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start_wall
            samples[name].append((cpu, wall))
    return samples


def paired_ratio(
    samples: dict[str, list[tuple[float, float]]], name: str, reference: str
) -> tuple[float, float]:
    """Median over rounds of ``name``'s step over ``reference``'s step in the same round:
    (CPU-time ratio, wall-clock ratio). Drift between rounds cancels, which it does not in a
    ratio of two medians."""
    pairs = list(zip(samples[name], samples[reference], strict=True))
    return (
        statistics.median(mine[0] / ref[0] for mine, ref in pairs),
        statistics.median(mine[1] / ref[1] for mine, ref in pairs),
    )


def sample_medians(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """Median (process CPU seconds, wall seconds) of one step's samples."""
    return statistics.median(c for c, _ in runs), statistics.median(w for _, w in runs)


def interleaved_cpu_wall(
    steps: dict[str, Callable[[], object]], rounds: int, warmup: int = 1
) -> dict[str, tuple[float, float]]:
    """Median (process CPU seconds, wall seconds) of each step over :func:`interleaved_samples`."""
    samples = interleaved_samples(steps, rounds, warmup)
    return {name: sample_medians(runs) for name, runs in samples.items()}


def _commit() -> str | None:
    """The checked-out commit (short), with ``-dirty`` when tracked files differ from it."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], capture_output=True, text=True, check=True, cwd=here
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    return commit


def measured_on(**more: Any) -> dict[str, Any]:
    """Where and when a result is measured: machine, torch version, torch threads (when torch
    is imported), date, commit and the command line; ``more`` adds to it."""
    torch = sys.modules.get("torch")
    record: dict[str, Any] = {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "torch": importlib.metadata.version("torch"),
        "threads": torch.get_num_threads() if torch is not None else None,
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "command": " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
    }
    return {**record, **more}


def emit(
    title: str,
    columns: Sequence[str],
    rows: Sequence[dict[str, Any]],
    as_json: bool,
    extra: dict[str, Any] | None = None,
) -> None:
    """Print rows as a rich table (or JSON with ``extra`` fields and, unless ``extra`` has
    one, a ``measured_on`` record: :func:`measured_on`)."""
    if as_json:
        result = {"title": title, "rows": list(rows), **(extra or {})}
        result.setdefault("measured_on", measured_on())
        print(json.dumps(result, indent=2))
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
