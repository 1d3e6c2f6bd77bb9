"""The executor's own cost per stage it runs, measured once per machine, and the time it adds.

Plans run stage by stage pay, per stage operation (a forward or a backward), the executor's Python
and autograd work (taps, hands, parameter leaves, an engine call) on top of the stage's compute,
which the profile measures and the planners count. :func:`cached_stage_seconds` keeps that cost,
measured (by :func:`edgetrain.runtime.checkpointed.measure_stage_seconds`) on
this machine: one step of a chain of tiny stages (``Linear(4, 4)``, whose compute is negligible)
run stage by stage through :class:`~edgetrain.runtime.checkpointed.Checkpointed`, over the same
step of plain
autograd, in paired rounds (the median of the per-round differences of process CPU time, which
other processes on the machine do not inflate), per stage operation. It is
measured once and kept in the cache directory (:mod:`edgetrain.cache`: a file per machine and
torch version, with a checksum verified when read); ``$EDGETRAIN_STAGE_SECONDS`` sets it instead.

:func:`with_stage_cost` is the chain whose stages each cost that much more, forward and backward:
a plan made on it under ``max_recompute=rho`` (with ``rho`` scaled to that chain's plain time,
:func:`time_factor`) runs, stage by stage, within ``rho`` times plain autograd's time. The executor
merges a plan's graph runs (:func:`~edgetrain.core.graph_merge.graph_runs`: stored stages,
recomputed pairs, checkpointed segments) into one stage each, so a plan pays the cost per stage
*operation as run* (:func:`executed_operations`), which is often far less: a plan that checkpoints
a few segments of a long chain runs as one graph. Inside a run, each unit that is rebuilt (a
checkpointed segment under :func:`torch.utils.checkpoint.checkpoint`, a recomputed pair:
:attr:`~edgetrain.core.graph_merge.GraphRun.rebuilds`) costs more than its compute (saved-tensor
hooks, its buffers and random-number state kept for the replay, a second graph), and so does each
stage it rebuilds; :func:`cached_rebuild_seconds` keeps both, measured once per machine as the
stage cost is. :func:`as_run` counts what a plan pays as it runs, :class:`ExecutorSeconds` prices
it, and :func:`within_time` ranks plans by their compute and that price.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from edgetrain.cache import machine, measured_path, measured_text, read_measured
from edgetrain.core.chain import Chain
from edgetrain.core.graph_merge import GraphRun, graph_runs, merged_schedule
from edgetrain.core.schedule import Op, Schedule, atomic_write_text, made_for
from edgetrain.core.simulator import simulate
from edgetrain.planners.optimal import store_all
from edgetrain.planners.search import FRONTIER_STRATEGIES, as_strategy, frontier, plan

CACHE_FILE = "stage_seconds.json"
KEYS = ("stage_seconds", "rebuild_seconds", "rebuilt_stage_seconds")
"""The values the cache file keeps."""
TIME_TRIES = 3
"""How many of the frontier's plans within ``max_recompute`` (least memory first) are prepared
and checked as they run before the plan that keeps to it stage by stage is taken."""
_memo: dict[str, float] = {}


def _machine() -> str:
    import torch

    return machine(f"torch {torch.__version__}")


def _value(stored: dict[str, Any], key: str) -> float | None:
    """``key``'s value among a cache file's ``stored`` values, or None (missing, not a number,
    out of range)."""
    try:
        value = float(stored[key])
    except (KeyError, TypeError, ValueError):
        return None
    return value if 0.0 <= value < 0.1 else None


def _read(path: os.PathLike[str] | str, key: str = "stage_seconds") -> float | None:
    """The cached value of ``key`` for this machine, or None (missing, another machine,
    damaged, out of range)."""
    return _value(read_measured(path, _machine()) or {}, key)


def _cached(keys: tuple[str, ...], measure: Callable[[], tuple[float, ...]]) -> tuple[float, ...]:
    """``$EDGETRAIN_<KEY>`` for each of ``keys`` (all given), else their values kept in the cache
    file for this machine, else ``measure()``, kept there beside the file's other values."""
    given = [os.environ.get(f"EDGETRAIN_{key.upper()}") for key in keys]
    if all(value is not None for value in given):
        return tuple(float(value) for value in given if value is not None)
    if all(key in _memo for key in keys):
        return tuple(_memo[key] for key in keys)
    machine_key = _machine()
    path = measured_path(CACHE_FILE, machine_key)
    stored = read_measured(path, machine_key) or {}  # the file read and checked once
    values = tuple(_value(stored, key) for key in keys)
    if any(value is None for value in values):
        measured = measure()
        kept = {k: v for k in KEYS if (v := _value(stored, k)) is not None}
        kept |= dict(zip(keys, measured, strict=True))
        with contextlib.suppress(OSError):  # unwritable: measured again by the next process
            atomic_write_text(path, measured_text(machine_key, kept))
        values = measured
    _memo.update(zip(keys, values, strict=True))
    return tuple(v for v in values if v is not None)


def cached_stage_seconds(measure: Callable[[], float]) -> float:
    """The executor's cost per stage operation on this machine, in seconds: ``measure()`` once per
    machine and torch version, kept in the cache directory (see the module;
    ``$EDGETRAIN_STAGE_SECONDS`` sets it instead)."""
    return _cached(("stage_seconds",), lambda: (measure(),))[0]


def cached_rebuild_seconds(measure: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """What a unit rebuilt inside a graph run costs on this machine beyond its compute, and each
    stage it rebuilds (see the module), in seconds: ``measure()`` once, kept as
    :func:`cached_stage_seconds` keeps its value (``$EDGETRAIN_REBUILD_SECONDS`` and
    ``$EDGETRAIN_REBUILT_STAGE_SECONDS`` set them instead)."""
    unit, stage = _cached(("rebuild_seconds", "rebuilt_stage_seconds"), measure)
    return unit, stage


@dataclass(frozen=True)
class AsRun:
    """What a plan costs the executor as it runs, besides its compute (counted by
    :func:`as_run`)."""

    operations: int  # stage operations (forwards and backwards) run by the executor
    rebuilds: int  # units rebuilt inside graph runs (GraphRun.rebuilds)
    rebuilt_stages: int  # stages computed again: by those units, and forwards run again


@dataclass(frozen=True)
class ExecutorSeconds:
    """This machine's costs of the executor (seconds), each measured once
    (:func:`edgetrain.runtime.checkpointed.executor_seconds`)."""

    operation: float  # a stage operation run stage by stage
    rebuild: float  # a unit rebuilt inside a graph run
    rebuilt_stage: float  # each stage computed again (in such a unit, or run again)

    def of(self, run: AsRun) -> float:
        """The executor's seconds for a plan that runs as ``run``."""
        return (
            self.operation * run.operations
            + self.rebuild * run.rebuilds
            + self.rebuilt_stage * run.rebuilt_stages
        )


def with_stage_cost(chain: Chain, seconds: float, rerun: float = 0.0) -> Chain:
    """``chain`` with ``seconds`` more for every stage's forward and backward, and ``rerun`` more
    for every forward (what a forward computed again costs beyond its compute, charged to every
    forward: on the safe side)."""
    stages = tuple(
        replace(s, forward_seconds=s.forward_seconds + seconds + rerun,
                backward_seconds=s.backward_seconds + seconds)
        for s in chain.stages
    )  # fmt: skip
    return replace(chain, stages=stages)


def time_factor(chain: Chain, rho: float, seconds: float, rerun: float = 0.0) -> float:
    """The recompute factor on :func:`with_stage_cost`'s chain that holds ``rho`` times
    ``chain``'s plain time: ``rho × plain / (plain + stages × (2 × seconds + rerun))``."""
    plain = chain.forward_seconds + chain.backward_seconds
    return rho * plain / (plain + chain.length * (2 * seconds + rerun))


def as_run(schedule: Schedule, runs: Sequence[GraphRun] | None = None) -> AsRun:
    """What ``schedule`` costs the executor with ``runs`` merged (default: all its graph runs,
    :func:`~edgetrain.core.graph_merge.graph_runs`): the stage operations it runs (none when one
    run spans the whole plan: one graph, run by plain autograd), the units rebuilt inside the
    runs, and the stages computed again (inside the runs, and each forward of a stage run stage
    by stage after its first)."""
    runs = graph_runs(schedule) if runs is None else runs
    units = sum(len(run.rebuilds) for run in runs)
    stages = sum(run.rebuilt_stages for run in runs)
    if len(runs) == 1 and (runs[0].first, runs[0].last) == (0, schedule.length - 1):
        return AsRun(0, units, stages)
    _, executed = merged_schedule(schedule, runs)
    forwards = executed.count(*(op for op in Op if op.is_forward))
    reruns = forwards - len({k for kind, k in executed if kind.is_forward})
    return AsRun(forwards + executed.count(Op.BACKWARD), units, stages + reruns)


def time_limit(chain: Chain, rho: float) -> float:
    """``rho`` times ``chain``'s plain time (seconds), with the simulator's rounding as slack:
    what a plan under ``max_recompute=rho`` may predict."""
    return rho * (chain.forward_seconds + chain.backward_seconds) * (1 + 1e-9)


def within_time(
    chain: Chain,
    plans: list[tuple[int, float, Schedule]],
    rho: float,
    seconds: ExecutorSeconds,
) -> list[Schedule]:
    """Of ``plans`` (peak bytes, compute seconds, schedule), those whose compute plus the
    executor's seconds as they run (:func:`as_run`) is at most ``rho`` times ``chain``'s plain
    time, least peak first (ties: the faster)."""
    limit = time_limit(chain, rho)
    kept = []
    for peak, compute, schedule in plans:
        total = compute + seconds.of(as_run(schedule))
        if total <= limit:
            kept.append((peak, total, schedule))
    kept.sort(key=lambda item: (item[0], item[1]))
    return [schedule for _, _, schedule in kept]


def planned_stage_by_stage(
    chain: Chain, strategy: str, rho: float, seconds: ExecutorSeconds, grads_exist: bool
) -> Schedule:
    """The least-memory plan that, run stage by stage (``seconds.operation`` per stage operation,
    ``seconds.rebuilt_stage`` per forward computed again) on top of the stages' compute, takes
    at most ``rho`` times plain autograd's time (which runs the module itself): within ``rho``
    whatever runs the executor merges, less what they rebuild."""
    factor = time_factor(chain, rho, seconds.operation, seconds.rebuilt_stage)
    if factor < 1.0 <= rho:
        return store_all(chain)  # only plain autograd's own step keeps to rho
    return plan(
        with_stage_cost(chain, seconds.operation, seconds.rebuilt_stage),
        strategy,
        max_recompute=max(factor, 1.0) if rho >= 1.0 else rho,
        grads_exist=grads_exist,
    )


def plans_within_time(
    chain: Chain, strategy: str, rho: float, seconds: ExecutorSeconds, grads_exist: bool
) -> list[Schedule]:
    """Plans to try for ``max_recompute=rho``, least memory first: the frontier's plans whose
    compute and executor seconds *as run* (:func:`within_time`) keep to ``rho``, the first
    :data:`TIME_TRIES` of them, then :func:`planned_stage_by_stage`'s plan. The executor merges a
    run only where it fits, so the caller checks each as it runs."""
    safe = planned_stage_by_stage(chain, strategy, rho, seconds, grads_exist)
    if strategy not in FRONTIER_STRATEGIES:
        return [safe]
    below = simulate(chain, safe, grads_exist=grads_exist).peak_bytes
    points = frontier(chain, strategy, grads_exist=grads_exist).points
    plans = [(p.peak_bytes, p.seconds, p.schedule) for p in points if p.peak_bytes < below]
    params: dict[str, object] = {"recompute_target": rho}
    tried = [
        made_for(as_strategy(_without_budget(s), strategy, params), chain)
        for s in within_time(chain, plans, rho, seconds)[:TIME_TRIES]
    ]
    return [*tried, safe]


def _without_budget(schedule: Schedule) -> Schedule:
    """``schedule`` without the budget of the table that made it: a plan chosen for a recompute
    factor keeps no memory budget (the executor merges its runs as for ``max_recompute``)."""
    params = {k: v for k, v in schedule.params.items() if k != "budget_bytes"}
    return Schedule(schedule.length, schedule.kinds, schedule.indices, schedule.strategy, params)
