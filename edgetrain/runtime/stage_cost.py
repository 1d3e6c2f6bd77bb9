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
measured once and kept in the cache directory (``$EDGETRAIN_CACHE_DIR``, else the user's cache),
per machine and torch version; ``$EDGETRAIN_STAGE_SECONDS`` sets it instead.

:func:`with_stage_cost` is the chain whose stages each cost that much more, forward and backward:
a plan made on it under ``max_recompute=rho`` (with ``rho`` scaled to that chain's plain time,
:func:`time_factor`) runs, stage by stage, within ``rho`` times plain autograd's time.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
from collections.abc import Callable
from dataclasses import replace

from edgetrain.cache import cache_dir
from edgetrain.core.chain import Chain
from edgetrain.core.schedule import atomic_write_text

CACHE_FILE = "stage_seconds.json"
_memo: float | None = None


def _machine() -> str:
    import torch

    return f"{platform.node()}|{platform.machine()}|{os.cpu_count()}|torch {torch.__version__}"


def _read(path: os.PathLike[str] | str) -> float | None:
    """The cached value for this machine, or None (missing, another machine, damaged)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        value = float(data["stage_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data.get("machine") != _machine() or not 0.0 <= value < 0.1:
        return None
    return value


def cached_stage_seconds(measure: Callable[[], float]) -> float:
    """The executor's cost per stage operation on this machine, in seconds: ``measure()`` once per
    machine and torch version, kept in the cache directory (see the module)."""
    global _memo
    given = os.environ.get("EDGETRAIN_STAGE_SECONDS")
    if given is not None:
        return float(given)
    if _memo is not None:
        return _memo
    path = cache_dir() / CACHE_FILE
    value = _read(path)
    if value is None:
        value = measure()
        with contextlib.suppress(OSError):  # unwritable: measured again by the next process
            atomic_write_text(
                path, json.dumps({"machine": _machine(), "stage_seconds": value}) + "\n"
            )
    _memo = value
    return value


def with_stage_cost(chain: Chain, seconds: float) -> Chain:
    """``chain`` with ``seconds`` more for every stage's forward and backward."""
    stages = tuple(
        replace(s, forward_seconds=s.forward_seconds + seconds,
                backward_seconds=s.backward_seconds + seconds)
        for s in chain.stages
    )  # fmt: skip
    return replace(chain, stages=stages)


def time_factor(chain: Chain, rho: float, seconds: float) -> float:
    """The recompute factor on :func:`with_stage_cost`'s chain that holds ``rho`` times
    ``chain``'s plain time: ``rho × plain / (plain + 2 × stages × seconds)``."""
    plain = chain.forward_seconds + chain.backward_seconds
    return rho * plain / (plain + 2 * chain.length * seconds)
