"""Budget search, both ways, for every strategy: one entry point, :func:`plan`.

* a memory budget: the fastest plan whose peak fits;
* a recompute factor ρ: the plan with the smallest peak whose time is at most ρ × plain autograd's.

``sequential`` and ``revolve`` have one integer knob each (segments, slots): every value is
simulated and the best kept. ``optimal`` reads both answers off one dynamic-programming table:
its row for the whole chain gives the least time for every budget at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from edgetrain.chain import Chain
from edgetrain.devices import energy
from edgetrain.devices.energy import EnergyProfile
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.planners.optimal import (
    DEFAULT_SLOTS,
    OptimalTable,
    TableMaker,
    fastest,
    store_all,
)
from edgetrain.planners.revolve import revolve
from edgetrain.planners.sequential import sequential
from edgetrain.schedule import Cost, Schedule, simulate
from edgetrain.units import format_bytes, parse_bytes

STRATEGIES = ("optimal", "blocks", "revolve", "sequential")

_TOLERANCE = 1e-9


def plan(
    chain: Chain,
    strategy: str = "optimal",
    *,
    memory: float | str | None = None,
    recompute: float | None = None,
    slots: int = DEFAULT_SLOTS,
    grads_exist: bool = False,
    device: str | EnergyProfile | None = None,
    runtime: float | None = None,
) -> Schedule:
    """The best plan of ``strategy`` for ``chain`` within ``memory`` or ``recompute`` factor.

    With neither, the fastest plan of the strategy. ``strategy="blocks"`` is rotor's DP over the
    chain's blocks (stages between single-tensor cuts), each block run in one of several ways
    (:mod:`edgetrain.planners.blocks`); it returns a schedule of the chain's own stages.
    ``strategy="poet"`` is the least-*energy*
    plan of recomputation and paging on ``device`` (a profile or its name, e.g. ``"rpi4"``)
    within ``memory`` and ``runtime`` (POET's multiplier of one pass over every node), found by
    the MILP (:func:`edgetrain.planners.poet_schedule.plan_poet`, which also returns its proof);
    a plan that pages needs ``Checkpointed(..., page_dir=...)``.

    ``memory`` (bytes, or a size such as "1GB" or "512MiB", as everywhere in edgetrain) counts
    what the step holds above what it starts with: activations, graphs, activation gradients and
    the parameter gradients it creates (see :class:`~edgetrain.schedule.Cost`; ``grads_exist``
    as in :func:`~edgetrain.schedule.simulate`).
    Raises :class:`InfeasibleBudget` with the smallest feasible value when nothing fits.
    """
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
    if strategy in ("optimal", "blocks"):
        schedule = _plan_best(chain, strategy, memory, recompute, slots, grads_exist)
    else:
        family: Callable[[Chain], list[Schedule]] = (
            _sequential_family if strategy == "sequential" else _revolve_family
        )
        schedule = _pick(chain, strategy, family(chain), memory, recompute, grads_exist)
    return made_for(schedule, chain)


def _plan_poet(
    chain: Chain,
    memory: float | None,
    recompute: float | None,
    grads_exist: bool,
    device: str | EnergyProfile | None,
    runtime: float | None,
) -> Schedule:
    from edgetrain.planners.poet_schedule import plan_poet

    if device is None or memory is None:
        raise InvalidInput(
            "strategy 'poet' needs a device (e.g. device='rpi4') and a memory budget"
        )
    if recompute is not None:
        raise InvalidInput("strategy 'poet' takes runtime= (a multiplier), not recompute=")
    if grads_exist:
        raise InvalidInput(
            "strategy 'poet' plans for gradients the step creates (zero_grad() to None); "
            "drop grads_exist"
        )
    profile = energy.get(device) if isinstance(device, str) else device
    return plan_poet(chain, profile, memory=memory, runtime=runtime).schedule


def made_for(schedule: Schedule, chain: Chain) -> Schedule:
    """``schedule`` with a record of what it was made for (the chain's fingerprint, its name and
    input size), which :class:`~edgetrain.execute.Checkpointed` checks before running it."""
    record = {
        "chain": chain.fingerprint(),
        "model": chain.name,
        "input_bytes": chain.input_bytes,
        "weight_bytes": chain.weight_bytes,
        "stages": chain.length,
    }
    params = {**schedule.params, "made_for": record}
    return Schedule(schedule.length, schedule.kinds, schedule.indices, schedule.strategy, params)


def _sequential_family(chain: Chain) -> list[Schedule]:
    return [sequential(chain, s) for s in range(1, chain.length + 1)]


def _revolve_family(chain: Chain) -> list[Schedule]:
    return [revolve(chain, s) for s in range(1, chain.length + 1)]


def _pick(
    chain: Chain,
    strategy: str,
    candidates: list[Schedule],
    memory: float | None,
    recompute: float | None,
    grads_exist: bool = False,
) -> Schedule:
    costs: list[tuple[Cost, Schedule]] = [
        (simulate(chain, s, grads_exist=grads_exist), s) for s in candidates
    ]
    if memory is not None:
        fitting = [(c, s) for c, s in costs if c.peak_bytes <= memory]
        if not fitting:
            smallest = min(c.peak_bytes for c, _ in costs)
            raise InfeasibleBudget(
                f"{strategy} needs at least {smallest} bytes of activation memory, "
                f"the budget leaves {int(memory)}; give more memory or use strategy 'optimal'",
                smallest,
            )
        return min(fitting, key=lambda cs: (cs[0].seconds, cs[0].peak_bytes))[1]
    if recompute is not None:
        fitting = [(c, s) for c, s in costs if c.recompute_factor <= recompute + _TOLERANCE]
        if not fitting:
            smallest_rho = min(c.recompute_factor for c, _ in costs)
            raise InfeasibleBudget(
                f"{strategy} cannot keep the recompute factor at {recompute}; the smallest it "
                f"reaches is {smallest_rho:.3f}",
                smallest_rho,
            )
        return min(fitting, key=lambda cs: (cs[0].peak_bytes, cs[0].seconds))[1]
    return min(costs, key=lambda cs: (cs[0].seconds, cs[0].peak_bytes))[1]


FLAT_UP_TO = 256
"""``optimal`` plans a chain of at most this many stages on its stages too (the flat DP); a
longer one only over its blocks: fewer DP stages, so a finer memory resolution in less time
(ResNet-152 captured, batch 8, 224²: 313 stages in 55 blocks, least memory 351.6 MiB in 1.3 s;
flat, 895 MiB in 7 s)."""


def _makers(chain: Chain, strategy: str, slots: int, grads_exist: bool) -> list[TableMaker]:
    """The DP tables a strategy searches: ``blocks``, the chain's blocks; ``optimal``, its own
    stages (up to :data:`FLAT_UP_TO`) and, where single-tensor cuts group its stages into
    blocks, its blocks. Each finds plans the other misses: the flat DP may place checkpoints
    across a block's boundary; the block DP counts a skip carried across cuts inside a block
    once (the flat DP counts it at every cut, on the safe side)."""
    from edgetrain.planners.blocks import block_plan, blocks_of

    makers = []
    if strategy == "optimal" and chain.length <= FLAT_UP_TO:
        makers.append(TableMaker(chain, grads_exist))
    if strategy == "blocks" or len(blocks_of(chain)) < chain.length or not makers:
        makers.append(block_plan(chain, grads_exist=grads_exist, slots=slots).maker())
    return makers


def _plan_best(
    chain: Chain,
    strategy: str,
    memory: float | None,
    recompute: float | None,
    slots: int,
    grads_exist: bool,
) -> Schedule:
    """The best of the plans of :func:`_makers`' tables: the fastest that fits ``memory``, or
    the smallest peak within ``recompute`` (each checked by the simulator)."""
    found: list[tuple[Cost, Schedule]] = []
    smallest: list[float] = []
    for maker in _makers(chain, strategy, slots, grads_exist):
        try:
            schedule = _plan_optimal(maker, memory, recompute, slots)
        except InfeasibleBudget as exc:
            if exc.smallest is not None:
                smallest.append(exc.smallest)
            error = exc
            continue
        found.append((simulate(chain, schedule, grads_exist=grads_exist), schedule))
    if not found:
        if len(smallest) > 1:
            least = min(smallest)
            raise InfeasibleBudget(
                f"no plan fits in {memory:.0f} bytes; the smallest that works is {least:.0f} bytes",
                least,
            )
        raise error
    if recompute is not None:
        _, best = min(found, key=lambda cs: (cs[0].peak_bytes, cs[0].seconds, len(cs[1])))
    else:
        _, best = min(found, key=lambda cs: (cs[0].seconds, cs[0].peak_bytes, len(cs[1])))
    over = "blocks" if best.strategy == "blocks" else "stages"
    return Schedule(best.length, best.kinds, best.indices, strategy, {**best.params, "over": over})


def least_memory_of(
    chain: Chain, *, grads_exist: bool = False, slots: int = DEFAULT_SLOTS
) -> float:
    """The smallest activation budget (bytes) with which ``plan(chain, "optimal", memory=...)``
    finds a plan: the least of its tables' (see :func:`_makers`)."""
    from edgetrain.planners.optimal import least_memory

    return min(
        least_memory(maker, slots) for maker in _makers(chain, "optimal", slots, grads_exist)
    )


def _plan_optimal(
    maker: TableMaker, memory: float | None, recompute: float | None, slots: int
) -> Schedule:
    chain = maker.chain
    grads_exist = maker.grads_exist
    if memory is not None:
        return fastest(maker, memory, slots)
    if recompute is None:
        return maker.everything()
    # One table over [0, the store-everything peak] answers every budget at once.
    table = _curve_table(maker, slots)
    limit = recompute * (chain.forward_seconds + chain.backward_seconds) * (1 + _TOLERANCE)
    candidates = [maker.everything()]  # factor 1: always within any target >= 1
    ok = np.flatnonzero(table.times() <= limit)
    if ok.size:
        candidates.append(table.schedule(int(ok[0]), {"recompute_target": recompute}))
    costs = [(simulate(chain, s, grads_exist=grads_exist), s) for s in candidates]
    fitting = [(c, s) for c, s in costs if c.recompute_factor <= recompute + _TOLERANCE]
    best = min(fitting, key=lambda cs: (cs[0].peak_bytes, cs[0].seconds))[1]
    return Schedule(
        best.length,
        best.kinds,
        best.indices,
        maker.strategy,
        {**best.params, "recompute_target": recompute},
    )


def _curve_table(maker: TableMaker, slots: int) -> OptimalTable:
    """A table whose budgets run from 0 to the store-everything peak."""
    chain = maker.chain
    everything = simulate(chain, store_all(chain), grads_exist=maker.grads_exist).peak_bytes
    slot_bytes, count = maker.resolution(max(everything, 1), slots)
    return maker.table(slot_bytes, count)


def plan_for_device(
    chain: Chain,
    strategy: str,
    *,
    device_bytes: float | None,
    fixed_bytes: int,
    recompute: float | None = None,
    slots: int = DEFAULT_SLOTS,
    grads_exist: bool = False,
) -> Schedule:
    """:func:`plan` when the budget is a whole device's memory, not only the activations'.

    ``fixed_bytes`` (weights, gradients, optimizer state, buffers, input) come off the top of
    ``device_bytes``; an infeasible budget is reported in the same terms: the smallest device
    memory that works.
    """
    if device_bytes is None:
        return plan(chain, strategy, recompute=recompute, slots=slots, grads_exist=grads_exist)
    if recompute is not None:
        raise InvalidInput("give a memory budget or a recompute factor, not both")
    if device_bytes <= fixed_bytes:
        raise InfeasibleBudget(
            f"{format_bytes(device_bytes)} does not hold the weights, gradients, optimizer state, "
            f"buffers and input ({format_bytes(fixed_bytes)}); give more memory",
            fixed_bytes,
        )
    try:
        # fixed_bytes holds gradients kept from the last step, so plan for that loop: a loop
        # that sets them to None then needs no more (what it creates is at most what is kept).
        return plan(
            chain, strategy, memory=device_bytes - fixed_bytes, slots=slots, grads_exist=True
        )
    except InfeasibleBudget as exc:
        if exc.smallest is None:
            raise
        smallest = int(fixed_bytes + exc.smallest)
        raise InfeasibleBudget(
            f"{strategy} cannot train in {format_bytes(device_bytes)}; the smallest memory that "
            f"works is {format_bytes(smallest)} ({smallest} bytes)",
            smallest,
        ) from exc


def tradeoff(
    chain: Chain, strategy: str = "optimal", slots: int = DEFAULT_SLOTS
) -> list[tuple[float, int]]:
    """The memory/recompute trade-off curve: Pareto points ``(recompute_factor, peak_bytes)``.

    ``optimal`` (and ``blocks``, on the chain's blocks): one table over budgets up to the
    store-everything peak, each point a budget
    (peak bytes are the budget's upper bound, within one slot). ``revolve``/``sequential``: every
    knob value, simulated. Sorted by recompute factor, each point using less memory than the last.
    """
    if strategy not in STRATEGIES:
        raise InvalidInput(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    plain = chain.forward_seconds + chain.backward_seconds
    points: list[tuple[float, int]]
    if strategy in ("optimal", "blocks"):
        table = _curve_table(_makers(chain, strategy, slots, False)[0], slots)
        points = [
            (float(t) / plain, math.ceil(m * table.slot_bytes))
            for m, t in enumerate(table.times())
            if math.isfinite(t)
        ]
        points.append((1.0, simulate(chain, store_all(chain)).peak_bytes))
    else:
        family = _sequential_family if strategy == "sequential" else _revolve_family
        points = [
            (c.recompute_factor, c.peak_bytes) for c in (simulate(chain, s) for s in family(chain))
        ]
    pareto: list[tuple[float, int]] = []
    for rho, peak in sorted(points):
        if not pareto or peak < pareto[-1][1]:
            pareto.append((rho, peak))
    return pareto
