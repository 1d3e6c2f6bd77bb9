"""Budget search, both ways, for every strategy: one entry point, :func:`plan`.

* a memory budget: the fastest plan whose peak fits;
* a recompute factor ρ: the plan with the smallest peak whose time is at most ρ × plain autograd's.

``sequential`` and ``revolve`` have one integer knob each (segments, slots): every value is
simulated and the best kept. ``optimal`` reads both answers off one dynamic-programming table:
its row for the whole chain gives the least time for every budget at once.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Schedule, made_for
from edgetrain.core.simulator import simulate
from edgetrain.devices import energy
from edgetrain.devices.energy import EnergyProfile
from edgetrain.errors import InfeasibleBudget, InvalidInput, InvalidSchedule
from edgetrain.planners.blocks import block_plan, cut_sets
from edgetrain.planners.budget import (
    Frontier,
    Measured,
    Point,
    family_candidates,
    frontier_of,
    optimal_candidates,
)
from edgetrain.planners.optimal import (
    DEFAULT_SLOTS,
    MIN_SLOTS,
    TableMaker,
    fastest_at,
    max_slots,
)
from edgetrain.planners.poet.to_schedule import plan_poet
from edgetrain.planners.revolve import revolve
from edgetrain.planners.sequential import sequential
from edgetrain.units import format_bytes, parse_bytes

FRONTIER_STRATEGIES = ("optimal", "blocks", "revolve", "sequential")
"""The strategies whose plans form a memory/time frontier that the budget search walks (see
:func:`frontier`); POET's MILP solves for one budget at a time."""
STRATEGIES = (*FRONTIER_STRATEGIES, "poet")
"""Every strategy :func:`plan` takes."""

_TOLERANCE = 1e-9


def plan(
    chain: Chain,
    strategy: str = "optimal",
    *,
    memory: float | str | None = None,
    max_recompute: float | None = None,
    slots: int = DEFAULT_SLOTS,
    grads_exist: bool = False,
    device: str | EnergyProfile | None = None,
    runtime: float | None = None,
    recompute: float | None = None,
) -> Schedule:
    """The best plan of ``strategy`` for ``chain`` within ``memory`` or ``max_recompute``.

    With neither, the fastest plan of the strategy. ``strategy="blocks"`` is rotor's DP over the
    chain's blocks (stages between cuts one tensor crosses), each block run in one of several ways
    (:mod:`edgetrain.planners.blocks`); it returns a schedule of the chain's own stages.
    ``strategy="poet"`` is the least-*energy*
    plan of recomputation and paging on ``device`` (a profile or its name, e.g. ``"rpi4"``)
    within ``memory`` and ``runtime`` (POET's multiplier of one pass over every node), found by
    the MILP (:func:`edgetrain.planners.poet.to_schedule.plan_poet`, which also returns its proof);
    a plan that pages needs ``Checkpointed(..., page_dir=...)``.

    ``memory`` (bytes, or a size such as "1GB" or "512MiB", as everywhere in edgetrain) counts
    what the step holds above what it starts with: activations, graphs, activation gradients and
    the parameter gradients it creates (see :class:`~edgetrain.core.simulator.Cost`; ``grads_exist``
    as in :func:`~edgetrain.core.simulator.simulate`).
    ``max_recompute`` is the largest recompute factor (the plan's time over plain autograd's),
    the keyword :class:`~edgetrain.runtime.checkpointed.Checkpointed` takes too; ``recompute=`` is
    its previous name, kept for one release.
    Raises :class:`InfeasibleBudget` with the smallest feasible value when nothing fits.
    """
    recompute = _renamed_recompute(max_recompute, recompute)
    if memory is not None:
        memory = parse_bytes(memory)
    if strategy == "poet":
        return _plan_poet(chain, memory, recompute, grads_exist, device, runtime)
    if strategy not in STRATEGIES:
        raise InvalidInput(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if memory is not None and recompute is not None:
        raise InvalidInput("give a memory budget or a recompute factor, not both")
    if recompute is not None and (not math.isfinite(recompute) or recompute < 1):
        raise InvalidInput(
            f"recompute factor {recompute} is below 1: no plan is faster than plain autograd; "
            "give a factor >= 1 (e.g. 1.5)"
        )
    if memory is not None and memory <= 0:
        raise InvalidInput("the memory budget must be positive; give e.g. 512MB")
    frontier = frontier_for(chain, strategy, grads_exist, slots)
    if memory is not None:
        point = frontier.within_memory(memory)
        if strategy in ("optimal", "blocks") and not frontier.exact:
            point = _refined(chain, strategy, slots, grads_exist, memory, point)
        params: dict[str, object] = {"budget_bytes": int(memory)}
    elif recompute is not None:
        point = frontier.within_factor(recompute)
        params = {"recompute_target": recompute}
    else:
        point = frontier.points[-1]  # the fastest
        params = {}
    schedule = as_strategy(point.schedule, strategy, params)
    return made_for(schedule, chain)


def _renamed_recompute(max_recompute: float | None, recompute: float | None) -> float | None:
    """``max_recompute``, or the deprecated ``recompute=`` given instead (with a warning)."""
    if recompute is None:
        return max_recompute
    if max_recompute is not None:
        raise InvalidInput("give max_recompute= only (recompute= is its previous name)")
    warnings.warn(
        "recompute= is deprecated and goes in the next release; use max_recompute=",
        DeprecationWarning,
        stacklevel=3,
    )
    return recompute


def _plan_poet(
    chain: Chain,
    memory: float | None,
    recompute: float | None,
    grads_exist: bool,
    device: str | EnergyProfile | None,
    runtime: float | None,
) -> Schedule:
    if device is None or memory is None:
        raise InvalidInput(
            "strategy 'poet' needs a device (e.g. device='rpi4') and a memory budget"
        )
    if recompute is not None:
        raise InvalidInput("strategy 'poet' takes runtime= (a multiplier), not max_recompute=")
    if grads_exist:
        raise InvalidInput(
            "strategy 'poet' plans for gradients the step creates (zero_grad() to None); "
            "drop grads_exist"
        )
    profile = energy.get(device) if isinstance(device, str) else device
    return plan_poet(chain, profile, memory=memory, runtime=runtime).schedule


def _sequential_family(chain: Chain) -> list[Schedule]:
    return [sequential(chain, s) for s in range(1, chain.length + 1)]


def _revolve_family(chain: Chain) -> list[Schedule]:
    return [revolve(chain, s) for s in range(1, chain.length + 1)]


def as_strategy(schedule: Schedule, strategy: str, params: dict[str, object]) -> Schedule:
    """``schedule`` labelled as ``strategy``'s, with ``params`` (and, for the DP, whether its
    table was over the chain's stages or its blocks)."""
    info = {**schedule.params, **params}
    if strategy in ("optimal", "blocks"):
        info["over"] = "blocks" if schedule.strategy == "blocks" else "stages"
    return Schedule(schedule.length, schedule.kinds, schedule.indices, strategy, info)


def candidates_of(
    chain: Chain, strategy: str, slots: int, grads_exist: bool
) -> Callable[[Measured], bool]:
    """The plans a strategy chooses among, whatever the budget (see
    :mod:`edgetrain.planners.budget`), and whether they are exact."""
    if strategy == "sequential":
        return family_candidates(lambda: _sequential_family(chain))
    if strategy == "revolve":
        return family_candidates(lambda: _revolve_family(chain))
    return optimal_candidates(list(_makers(chain, strategy, slots, grads_exist)), slots)


def frontier(
    chain: Chain,
    strategy: str = "optimal",
    *,
    grads_exist: bool = False,
    slots: int = DEFAULT_SLOTS,
) -> Frontier:
    """The Pareto frontier of ``strategy``'s plans on ``chain``: from the smallest feasible
    budget to storing everything (see :mod:`edgetrain.planners.budget`)."""
    if strategy == "poet":
        raise InvalidInput(
            "poet's MILP plans one budget at a time and has no frontier; choose one of "
            f"{', '.join(FRONTIER_STRATEGIES)}"
        )
    if strategy not in STRATEGIES:
        raise InvalidInput(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    return frontier_for(chain, strategy, grads_exist, slots)


KEPT = 8
"""Frontiers (and the DP tables' makers) kept, by chain, strategy, loop and slots, so that a
retry, ``"min"``, ``"auto"`` and the frontier itself plan once."""

FLAT_UP_TO = 256
"""``optimal`` plans a chain of at most this many stages on its stages too (the flat DP); a
longer one only over its blocks: fewer DP stages, so a finer memory resolution in less time
(ResNet-152 captured, batch 8, 224²: 313 stages in 55 blocks, least memory 351.6 MiB in 1.3 s;
flat, 895 MiB in 7 s). At 128, LinearResNet-152's least memory within ρ 1.6 is 3 % larger."""


REFINE_WORK = 1.5e7
"""Table cells times split points (about a tenth of a second) a query spends at most on a
table at its budget's own resolution. Beyond, the frontier's tables answer alone: on random
heterogeneous chains of 60 to 200 stages the finer table changed the recompute factor at 0.9,
0.5 and 0.3 × the store-all peak by at most 1e-4, for 1 to 3 s a query; on a frozen BERT-base
with LoRA adapters (``benchmarks/frozen.py``) by 3.5e-3 (1.215 against 1.212)."""


def _refined(
    chain: Chain, strategy: str, slots: int, grads_exist: bool, memory: float, point: Point
) -> Point:
    """``point`` (the frontier's fastest plan within ``memory``), or a faster plan from a table
    at the budget's own resolution (one per maker: its plans for budgets up to ``memory``,
    each checked by the simulator). Only ever a plan that fits: a budget the frontier refuses is
    refused whatever such a table finds, so feasibility stays the frontier's."""
    best = point
    plain = chain.forward_seconds + chain.backward_seconds
    for maker in _makers(chain, strategy, slots, grads_exist):
        _, count = maker.resolution(memory, slots)
        if maker.stages**3 / 3 * count > REFINE_WORK:
            continue  # the frontier's tables stand: a finer one would cost seconds
        found = fastest_at(maker, memory, slots)
        if found is None:
            continue
        try:
            cost = simulate(chain, found, grads_exist=grads_exist)
        except InvalidSchedule:
            if maker.checked:  # a plan the simulator rejects is dropped (TableMaker.checked)
                continue
            raise
        if cost.heap_peak_bytes <= memory and cost.seconds < best.seconds * (1 - 1e-12):
            best = Point(cost.heap_peak_bytes, cost.seconds, cost.seconds / plain, found)
    return best


@functools.lru_cache(maxsize=KEPT)
def _makers(chain: Chain, strategy: str, slots: int, grads_exist: bool) -> tuple[TableMaker, ...]:
    """The DP tables a strategy searches (kept: finding a block's options is work):
    ``blocks``, the chain's blocks (one table per set of cuts,
    :func:`~edgetrain.planners.blocks.cut_sets`); ``optimal``, its own stages (up to
    :data:`FLAT_UP_TO`) and, where cuts one tensor crosses group its stages into blocks, its
    blocks. Each finds plans
    the other misses: the flat DP may place checkpoints across a block's boundary; the block
    DP counts a skip carried across cuts inside a block once (the flat DP counts it at every
    cut, on the safe side). Beside the blocks, the flat DP runs only where its work limit leaves
    it more than :data:`MIN_SLOTS` slots: on random 200-stage chains of mixed stages (48 slots
    against the blocks' 160 to 180) it found no plan the blocks' tables miss, for a third of the
    planning time; at 150 stages (106 slots) it finds plans 2 % faster."""
    sets = cut_sets(chain)
    grouped = len(sets[0]) < chain.length - 1  # some cut is crossed by more than one tensor
    makers = []
    flat = chain.length <= FLAT_UP_TO and (not grouped or max_slots(chain.length) > MIN_SLOTS)
    if strategy == "optimal" and flat:
        makers.append(TableMaker(chain, grads_exist))
    if strategy == "blocks" or grouped or not makers:
        for cuts in sets:
            plan = block_plan(chain, cuts, grads_exist=grads_exist, slots=slots)
            makers.append(plan.maker())
    return tuple(makers)


def least_memory_of(
    chain: Chain, *, grads_exist: bool = False, slots: int = DEFAULT_SLOTS
) -> float:
    """The smallest activation budget (bytes) with which ``plan(chain, "optimal", memory=...)``
    finds a plan: the first point of its frontier."""
    return float(frontier_for(chain, "optimal", grads_exist, slots).smallest_bytes)


def plan_for_device(
    chain: Chain,
    strategy: str,
    *,
    device_bytes: float | None,
    fixed_bytes: int,
    max_recompute: float | None = None,
    slots: int = DEFAULT_SLOTS,
    grads_exist: bool = False,
) -> Schedule:
    """:func:`plan` when the budget is a whole device's memory, not only the activations'.

    ``fixed_bytes`` is what the step starts with in the loop ``grads_exist`` plans for (weights,
    buffers, input, optimizer state, and the gradients when the loop keeps them: see
    :func:`edgetrain.core.accounting.step_start_bytes`); it comes off the top of ``device_bytes``.
    An
    infeasible budget is reported in the same terms: ``fixed_bytes`` plus the least peak of any
    plan, the smallest device memory that plans.
    """
    if device_bytes is None:
        return plan(
            chain, strategy, max_recompute=max_recompute, slots=slots, grads_exist=grads_exist
        )
    if max_recompute is not None:
        raise InvalidInput("give a memory budget or a recompute factor, not both")
    if strategy == "poet":
        return plan(chain, strategy, memory=device_bytes - fixed_bytes, grads_exist=grads_exist)
    if strategy not in STRATEGIES:
        raise InvalidInput(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    least = frontier_for(chain, strategy, grads_exist, slots).smallest_bytes
    smallest = int(fixed_bytes + least)
    if device_bytes < smallest:
        gradients = ", gradients" if grads_exist else ""
        raise InfeasibleBudget(
            f"{strategy} cannot train in {format_bytes(device_bytes)}: the step starts with "
            f"{format_bytes(fixed_bytes)} (weights{gradients}, buffers, input, reserve) and its "
            f"activations need at least {format_bytes(least)}; the smallest memory that works "
            f"is {format_bytes(smallest)} ({smallest} bytes)",
            smallest,
        )
    return plan(
        chain, strategy, memory=device_bytes - fixed_bytes, slots=slots, grads_exist=grads_exist
    )


def tradeoff(
    chain: Chain,
    strategy: str = "optimal",
    slots: int = DEFAULT_SLOTS,
    *,
    grads_exist: bool = False,
) -> list[tuple[float, int]]:
    """The memory/recompute trade-off curve: the Pareto points ``(recompute_factor,
    peak_bytes)`` of the strategy's plans (see :func:`frontier`), sorted by recompute factor,
    each point using less memory than the last."""
    points = frontier(chain, strategy, grads_exist=grads_exist, slots=slots).points
    return [(p.recompute_factor, p.peak_bytes) for p in reversed(points)]


# -- the kept frontiers ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=KEPT)
def frontier_for(chain: Chain, strategy: str, grads_exist: bool, slots: int) -> Frontier:
    """The frontier of ``strategy``'s plans on ``chain`` (kept for the last :data:`KEPT`)."""
    return frontier_of(
        chain, strategy, candidates_of(chain, strategy, slots, grads_exist), grads_exist
    )


def forget() -> None:
    """Drop the kept frontiers (benchmarks time a first call)."""
    frontier_for.cache_clear()
    _makers.cache_clear()
