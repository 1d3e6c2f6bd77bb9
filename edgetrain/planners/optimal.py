"""The optimal checkpointing schedule for a heterogeneous chain, at any budget.

:class:`TableMaker` builds the dynamic program's tables (:mod:`edgetrain.planners.dp_table`) of
one chain at any resolution; :func:`optimal` and :func:`fastest` read the fastest plan within a
budget off them, each plan checked with the simulator; :func:`least_memory` the smallest budget
that plans. The one budget search over every planner is :mod:`edgetrain.planners.budget`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Schedule, store_all_operations
from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.planners.dp_table import (
    DEFAULT_SLOTS,
    MIN_SLOTS,
    Expand,
    OptimalTable,
    max_slots,
)
from edgetrain.planners.step_costs import StepCosts, chain_costs

__all__ = [
    "DEFAULT_SLOTS",
    "MIN_SLOTS",
    "OptimalTable",
    "StepCosts",
    "TableMaker",
    "chain_costs",
    "common_unit",
    "fastest",
    "fastest_at",
    "fastest_fitting",
    "least_memory",
    "max_slots",
    "minimum_memory",
    "optimal",
    "resolution",
    "store_all",
]


def store_all(chain: Chain) -> Schedule:
    """Plain autograd as a plan: every stage forward with its graph, then every backward."""
    kinds, indices = store_all_operations(chain.length)
    return Schedule(chain.length, kinds, indices, "optimal", {"budget_bytes": None})


@dataclass(frozen=True)
class TableMaker:
    """How to build tables of one chain's plans at any resolution: the chain's own stages
    (rotor's DP, the default) or other stages of the recursion (``costs``, ``expand``: see
    :class:`OptimalTable` and :mod:`edgetrain.planners.blocks`).

    Attributes:
        chain: the chain the plans are for (and the simulator checks them on).
        grads_exist: as in :func:`~edgetrain.core.schedule.simulate`.
        length: stages of the recursion (the chain's by default).
        unit: a size (bytes) every size of the recursion is a multiple of (0: none known).
        costs, expand, strategy, release: as in :class:`OptimalTable`.
        checked: its plans may not run (blocks whose cuts carry tensors an earlier block made:
            a plan may recompute a stage whose output a later block still holds); the
            simulator checks each and the ones it rejects are dropped.
    """

    chain: Chain
    grads_exist: bool = False
    length: int = 0
    unit: int = -1
    costs: Callable[[float, bool], StepCosts] | None = None
    expand: Expand | None = None
    strategy: str = "optimal"
    release: bool = True
    checked: bool = False

    @property
    def stages(self) -> int:
        """Stages of the recursion."""
        return self.length or self.chain.length

    def table(self, slot_bytes: float, slots: int, nearest: bool = False) -> OptimalTable:
        """The filled table at this resolution."""
        return OptimalTable(
            self.chain,
            slot_bytes,
            slots,
            grads_exist=self.grads_exist,
            nearest=nearest,
            costs=self.costs,
            expand=self.expand,
            strategy=self.strategy,
            release=self.release,
        )

    def resolution(self, budget_bytes: float, slots: int) -> tuple[float, int]:
        """Slot size and count for budgets up to ``budget_bytes`` (see :func:`resolution`)."""
        slots = min(slots, max_slots(self.stages))
        unit = common_unit(self.chain) if self.unit < 0 else self.unit
        if unit and budget_bytes / unit <= slots:
            return float(unit), int(budget_bytes // unit)
        return budget_bytes / slots, slots

    def rounding_matters(self, slot_bytes: float) -> bool:
        """Whether sizes rounded to the nearest slot of ``slot_bytes`` differ from sizes
        rounded up (where they do not, a nearest table is the rounded-up one again)."""
        up, near = self._costs(slot_bytes, False), self._costs(slot_bytes, True)
        return any(
            not np.array_equal(getattr(up, f.name), getattr(near, f.name))
            for f in fields(StepCosts)
        )

    def _costs(self, slot_bytes: float, nearest: bool) -> StepCosts:
        if self.costs is None:
            return chain_costs(self.chain, slot_bytes, self.grads_exist, nearest)
        return self.costs(slot_bytes, nearest)

    def everything(self) -> Schedule:
        """Storing every graph: plain autograd, the fastest plan."""
        schedule = store_all(self.chain)
        return Schedule(schedule.length, schedule.kinds, schedule.indices, self.strategy, {})


def optimal(
    chain: Chain, memory_bytes: float, slots: int = DEFAULT_SLOTS, *, grads_exist: bool = False
) -> Schedule:
    """The fastest plan whose simulated peak stays within ``memory_bytes`` (see
    :class:`~edgetrain.core.schedule.Cost`).

    One table for the budget (at most ``slots`` slots, fewer for long chains, see
    :func:`max_slots`; exactly the chain's common size unit when that needs no more): the plans it
    gives for budgets at and below ``memory_bytes`` are checked with the simulator, fastest
    first, and the first that fits is returned. Raises :class:`InfeasibleBudget` with the
    smallest budget that works (:func:`minimum_memory`) when no plan fits.
    """
    return fastest(TableMaker(chain, grads_exist), memory_bytes, slots)


def fastest(maker: TableMaker, memory_bytes: float, slots: int = DEFAULT_SLOTS) -> Schedule:
    """:func:`optimal` with the tables of ``maker``."""
    if memory_bytes <= 0:
        raise InvalidInput("the memory budget must be positive; give e.g. 512MB")
    schedule = _fastest_within(maker, memory_bytes, slots)
    if schedule is None:
        smallest = least_memory(maker, slots)
        raise InfeasibleBudget(
            f"no plan fits in {memory_bytes:.0f} bytes; the smallest that works is "
            f"{smallest:.0f} bytes",
            smallest,
        )
    return schedule


def resolution(chain: Chain, budget_bytes: float, slots: int = DEFAULT_SLOTS) -> tuple[float, int]:
    """Slot size (bytes) and slot count of the table for budgets up to ``budget_bytes``.

    When every size of the chain is a multiple of one unit and the budget is at most ``slots``
    units, the slot is that unit and the table is exact; otherwise ``budget_bytes / slots``.
    """
    return TableMaker(chain).resolution(budget_bytes, slots)


_MARGIN = 0.04
"""Budgets a little above the one asked for are tabled too: rounding may price a fitting plan
there."""


def _fastest_within(maker: TableMaker, memory_bytes: float, slots: int) -> Schedule | None:
    """:func:`optimal`'s search; None when nothing fits."""
    chain = maker.chain
    everything = maker.everything()
    if simulate(chain, everything, grads_exist=maker.grads_exist).heap_peak_bytes <= memory_bytes:
        schedule = everything  # nothing is faster than storing everything
    else:
        slot_bytes, count = maker.resolution(memory_bytes, slots)
        top = min(count + max(1, int(count * _MARGIN)), max_slots(maker.stages))
        top = max(top, count)
        table = maker.table(slot_bytes, top)
        found = fastest_fitting(table, memory_bytes, top)
        if found is not None:
            found = _widened(maker, memory_bytes, slots, found)
        if found is None:
            # Rounding up every size of a long chain can hide every plan; to the nearest slot
            # the errors cancel (the simulator checks each plan).
            near = maker.table(slot_bytes, top, nearest=True)
            found = fastest_fitting(near, memory_bytes, top)
        if found is None:
            # Coarse rounding can hide the smallest plans: the least-memory tables have them.
            for table in _least_memory_tables(maker, slots):
                found = fastest_fitting(table, memory_bytes)
                if found is not None:
                    break
        if found is None:
            return None
        schedule = found
    params = {**schedule.params, "budget_bytes": int(memory_bytes)}
    return Schedule(schedule.length, schedule.kinds, schedule.indices, maker.strategy, params)


def fastest_at(maker: TableMaker, memory_bytes: float, slots: int) -> Schedule | None:
    """The fastest plan that fits ``memory_bytes`` from a table at that budget's resolution
    (a little above it too, and widened where the chain carries tensors: see
    :func:`_widened`); None when that table has none (coarser or finer tables may)."""
    slot_bytes, count = maker.resolution(memory_bytes, slots)
    top = max(count, min(count + max(1, int(count * _MARGIN)), max_slots(maker.stages)))
    found = fastest_fitting(maker.table(slot_bytes, top), memory_bytes, top)
    return None if found is None else _widened(maker, memory_bytes, slots, found)


_WIDEN_BELOW = 0.95
"""A plan whose simulated peak is below this share of the budget has the table widened."""


def _widened(maker: TableMaker, memory_bytes: float, slots: int, found: Schedule) -> Schedule:
    """``found``, or a faster plan that fits from a table over a wider range of budgets.

    The table can price a plan well above its simulated peak: every size is rounded up, and a
    tensor carried unchanged through several stages (the skip of a residual block cut inside)
    is counted at each. ViT-Tiny (batch 8, 128², 126 stages) has its store-all plan priced at
    130 MiB against 77 simulated, so for a 70 MiB budget the table offered plans that simulate
    at 51 MiB (ρ 1.14) and never the one at 70 MiB (ρ 1.04). On a chain that carries tensors,
    when the plan found leaves more than 5 % of the budget unused, the table's range is
    stretched by the ratio seen (budget over simulated peak) and searched again, at most three
    times, and the fastest plan that fits is kept; the simulator checks every plan.
    """
    chain, grads_exist = maker.chain, maker.grads_exist
    if not any(stage.carried for stage in chain.stages):
        return found  # rounding alone: the margin above covers it
    reach = memory_bytes
    best, best_time = found, simulate(chain, found, grads_exist=grads_exist).seconds
    for _ in range(3):
        peak = simulate(chain, found, grads_exist=grads_exist).heap_peak_bytes
        if peak >= _WIDEN_BELOW * memory_bytes or peak <= 0:
            break
        reach *= memory_bytes / peak
        slot_bytes, count = maker.resolution(reach, slots)
        table = maker.table(slot_bytes, count)
        wider = fastest_fitting(table, memory_bytes, count)
        if wider is None:
            break
        found = wider
        seconds = simulate(chain, wider, grads_exist=grads_exist).seconds
        if seconds < best_time:
            best, best_time = wider, seconds
    return best


def fastest_fitting(
    table: OptimalTable, memory_bytes: float, top: int | None = None
) -> Schedule | None:
    """The fastest of the table's plans (budgets ``top`` down to 0) whose exact peak fits."""
    times = table.times()[: (table.slots if top is None else top) + 1]
    tried: set[bytes] = set()
    for m in np.argsort(times, kind="stable"):
        if not np.isfinite(times[m]):
            break
        schedule = table.schedule(int(m))
        key = schedule.kinds.tobytes() + schedule.indices.tobytes()
        if key in tried:
            continue  # the same plan as another budget's
        tried.add(key)
        if (
            simulate(table.chain, schedule, grads_exist=table.grads_exist).heap_peak_bytes
            <= memory_bytes
        ):
            return schedule
    return None


def _least_memory_table(maker: TableMaker, slots: int) -> OptimalTable:
    """A table at the resolution of the least memory any plan needs (estimated at the
    resolution of the store-everything peak)."""
    chain = maker.chain
    everything = simulate(chain, store_all(chain), grads_exist=maker.grads_exist).heap_peak_bytes
    slot_bytes, count = maker.resolution(max(everything, 1), slots)
    coarse = maker.table(slot_bytes, count)
    fewest = coarse.smallest_feasible_slots()
    if fewest is None:
        return coarse
    budget = max(1.0, (fewest + 1) * slot_bytes * (1 + _MARGIN))
    slot_bytes, count = maker.resolution(budget, slots)
    return maker.table(slot_bytes, count)


def _least_memory_tables(maker: TableMaker, slots: int) -> tuple[OptimalTable, OptimalTable]:
    """The tables whose plans :func:`minimum_memory` searches (and :func:`optimal` last): the
    least-memory table, and a table rounded to the nearest slot at the resolution of the
    store-everything peak."""
    chain = maker.chain
    everything = simulate(chain, store_all(chain), grads_exist=maker.grads_exist).heap_peak_bytes
    slot_bytes, count = maker.resolution(max(everything, 1), slots)
    near = maker.table(slot_bytes, count, nearest=True)
    return _least_memory_table(maker, slots), near


def minimum_memory(chain: Chain, slots: int = DEFAULT_SLOTS, *, grads_exist: bool = False) -> float:
    """The smallest activation budget (bytes) with which :func:`optimal` finds a plan: the least
    simulated peak of the plans of the least-memory tables (and of storing everything)."""
    return least_memory(TableMaker(chain, grads_exist), slots)


def least_memory(maker: TableMaker, slots: int = DEFAULT_SLOTS) -> float:
    """:func:`minimum_memory` with the tables of ``maker``."""
    chain = maker.chain
    grads_exist = maker.grads_exist
    best = float(simulate(chain, store_all(chain), grads_exist=grads_exist).heap_peak_bytes)
    for table in _least_memory_tables(maker, slots):
        times = table.times()
        for m in np.flatnonzero(np.isfinite(times))[:64]:
            peak = simulate(chain, table.schedule(int(m)), grads_exist=grads_exist).heap_peak_bytes
            best = min(best, float(peak))
    return best


def common_unit(chain: Chain) -> int:
    """The greatest common divisor of all the chain's sizes (0 if they are all 0)."""
    unit = 0
    for k, stage in enumerate(chain.stages):
        for size in (
            stage.output_bytes,
            stage.saved_bytes,
            stage.forward_peak_bytes,
            stage.forward_grad_peak_bytes,
            stage.backward_peak_bytes,
            stage.gradient_bytes,
            stage.shared_gradient_bytes,
            stage.forward_scratch_bytes,
            stage.backward_scratch_bytes,
            chain.gradient_of_activation_bytes(k),
        ):
            unit = math.gcd(unit, size)
    return unit
