"""The one budget search: every strategy's plans as one Pareto frontier, every answer read off it.

A strategy's *candidates* are a finite set of plans that does not depend on the budget asked for
(``sequential``/``revolve``: every value of their knob; ``optimal``/``blocks``: every plan of a
few dynamic-programming tables spanning all budgets, see :func:`plans_of`, and storing
everything). Each is simulated once; the ones no other beats in both peak and time make the
:class:`Frontier`, sorted by peak (ascending) and so by time (descending). Then, by construction:

* the fastest plan within a memory budget is the last point whose peak fits, so feasibility is
  monotone in the budget and the smallest feasible budget is the first point's peak, which
  itself plans (``budget == smallest`` plans; so does a retry with
  :attr:`~edgetrain.errors.InfeasibleBudget.smallest`);
* the least-memory plan within a recompute factor is the first point whose factor fits (ties: the
  faster, since the frontier keeps the fastest plan of each peak), feasible for every factor
  from the last point's on;
* the frontier itself is the memory/time trade-off (:func:`edgetrain.frontier`).

Where a table's slot is the chain's common size unit and it spans every budget up to storing
everything, the table is exact (:attr:`Frontier.exact`): its plans are the dynamic program's
optimum at every byte, so one byte less than the smallest does not plan. Frontiers are kept for
the last few (chain, strategy, loop) asked about, so that a retry, ``"min"``, ``"auto"`` and the
frontier itself plan once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Schedule
from edgetrain.core.simulator import Cost, simulate
from edgetrain.errors import InfeasibleBudget, InvalidSchedule
from edgetrain.planners.optimal import (
    MIN_SLOTS,
    OptimalTable,
    TableMaker,
    common_unit,
    max_slots,
)

TOLERANCE = 1e-9
"""Relative slack on a recompute factor (the simulator's sums of floats)."""

LEAST_MARGIN = 1.1
"""The least-memory table spans budgets up to this multiple of the least peak found so far."""


@dataclass(frozen=True)
class Point:
    """One plan of a frontier: its simulated peak (bytes above what the step starts with, kernel
    scratch included: ``Cost.heap_peak_bytes``), time (seconds) and recompute factor (time over
    plain autograd's)."""

    peak_bytes: int
    seconds: float
    recompute_factor: float
    schedule: Schedule


@dataclass(frozen=True)
class Frontier:
    """The Pareto frontier of a strategy's plans for one chain in one training loop.

    Attributes:
        strategy: the planner.
        grads_exist: the loop (see :func:`~edgetrain.core.simulator.simulate`).
        points: sorted by ``peak_bytes`` ascending; each strictly faster than the one before.
        exact: whether the frontier is the planner's optimum at every byte (exact tables, or
            a family of plans enumerated in full), so that one byte less than
            :attr:`smallest_bytes` has no plan.
    """

    strategy: str
    grads_exist: bool
    points: tuple[Point, ...]
    exact: bool

    @property
    def smallest_bytes(self) -> int:
        """The least peak of any plan: the smallest budget that plans."""
        return self.points[0].peak_bytes

    @property
    def smallest_factor(self) -> float:
        """The least recompute factor of any plan."""
        return self.points[-1].recompute_factor

    def fastest_within(self, memory_bytes: float) -> Point | None:
        """The fastest plan whose peak is at most ``memory_bytes`` (None: none fits)."""
        peaks = [p.peak_bytes for p in self.points]
        index = int(np.searchsorted(peaks, memory_bytes, side="right")) - 1
        return self.points[index] if index >= 0 else None

    def least_within(self, recompute: float) -> Point | None:
        """The least-memory plan whose recompute factor is at most ``recompute`` (ties: the
        faster; None: none keeps to it)."""
        limit = recompute * (1 + TOLERANCE)
        return next((p for p in self.points if p.recompute_factor <= limit), None)

    def within_memory(self, memory_bytes: float) -> Point:
        """:meth:`fastest_within`, or :class:`InfeasibleBudget` with the smallest budget."""
        point = self.fastest_within(memory_bytes)
        if point is None:
            smallest = self.smallest_bytes
            raise InfeasibleBudget(
                f"{self.strategy} needs at least {smallest} bytes of activation memory, the "
                f"budget leaves {memory_bytes:.0f}: no plan fits; the smallest that works is "
                f"{smallest} bytes",
                smallest,
            )
        return point

    def within_factor(self, recompute: float) -> Point:
        """:meth:`least_within`, or :class:`InfeasibleBudget` with the smallest factor."""
        point = self.least_within(recompute)
        if point is None:
            least = self.smallest_factor
            raise InfeasibleBudget(
                f"{self.strategy} cannot keep the recompute factor at {recompute}; the smallest "
                f"it reaches is {least:.4f}",
                least,
            )
        return point


def pareto(costs: Iterable[tuple[Cost, Schedule]], plain_seconds: float) -> tuple[Point, ...]:
    """The plans no other beats in both peak and time, by peak ascending (ties in peak: the
    fastest; ties in both: the one with fewer operations)."""
    ordered = sorted(costs, key=lambda cs: (cs[0].heap_peak_bytes, cs[0].seconds, len(cs[1])))
    points: list[Point] = []
    for cost, schedule in ordered:
        if points and cost.seconds >= points[-1].seconds * (1 - 1e-12):
            continue
        factor = cost.seconds / plain_seconds if plain_seconds > 0 else 1.0
        points.append(Point(cost.heap_peak_bytes, cost.seconds, factor, schedule))
    return tuple(points)


class Measured:
    """Simulated costs of plans on one chain in one loop, each distinct plan simulated once."""

    def __init__(self, chain: Chain, grads_exist: bool) -> None:
        self.chain = chain
        self.grads_exist = grads_exist
        self.costs: dict[bytes, tuple[Cost, Schedule]] = {}

    def cost(self, schedule: Schedule) -> Cost:
        """The simulated cost of ``schedule`` (kept)."""
        key = schedule.kinds.tobytes() + schedule.indices.tobytes()
        known = self.costs.get(key)
        if known is None:
            known = (simulate(self.chain, schedule, grads_exist=self.grads_exist), schedule)
            self.costs[key] = known
        return known[0]

    def valid(self, schedules: Iterable[Schedule]) -> list[Schedule]:
        """The ``schedules`` the simulator runs (see :attr:`TableMaker.checked`)."""
        kept = []
        for schedule in schedules:
            try:
                self.cost(schedule)
            except InvalidSchedule:
                continue
            kept.append(schedule)
        return kept

    def add(self, schedules: Iterable[Schedule]) -> float:
        """Simulate ``schedules``; the least peak among them (inf: none)."""
        return min((self.cost(s).heap_peak_bytes for s in schedules), default=math.inf)


def frontier_of(
    chain: Chain,
    strategy: str,
    candidates: Callable[[Measured], bool],
    grads_exist: bool,
) -> Frontier:
    """The frontier of the plans ``candidates`` adds to a :class:`Measured` (it returns whether
    they are exact), each simulated once in the loop ``grads_exist``."""
    measured = Measured(chain, grads_exist)
    exact = candidates(measured)
    plain = chain.forward_seconds + chain.backward_seconds
    return Frontier(strategy, grads_exist, pareto(measured.costs.values(), plain), exact)


# -- the dynamic program's candidates ------------------------------------------------------------


def plans_of(table: OptimalTable) -> list[Schedule]:
    """Every distinct plan of a table: one per budget at which its least time changes."""
    times = table.times()
    finite = np.flatnonzero(np.isfinite(times))
    if not finite.size:
        return []
    # A budget's plan differs from the one below only where the least time drops.
    changes = finite[np.concatenate([[True], times[finite[1:]] < times[finite[:-1]]])]
    return [table.schedule(int(m)) for m in changes]


def maker_plans(maker: TableMaker, slots: int, measured: Measured) -> bool:
    """Add the plans of ``maker``'s tables over every budget to ``measured``; whether the first
    table is exact.

    1. Budgets from 0 to the store-everything peak, sizes rounded up (every plan fits its
       budget) and, unless that table is exact, rounded to the nearest slot (on long chains of
       small stages, rounding every size up prices every plan out; to the nearest the errors
       cancel).
    2. Where a chain carries tensors across stages (counted at every stage they cross, on the
       safe side) the top plan may simulate well below its budget: the range is stretched by
       that ratio (at most 4 ×) so that plans up to storing everything are found.
    3. Budgets from 0 to :data:`LEAST_MARGIN` × the least peak found: the resolution where the
       smallest budgets are (where that is finer than the first tables').
    """
    chain = maker.chain

    def table_plans(table: OptimalTable) -> list[Schedule]:
        found = plans_of(table)
        return measured.valid(found) if maker.checked else found

    top = max(measured.cost(maker.everything()).heap_peak_bytes, 1)
    slot_bytes, count = maker.resolution(top, slots)
    unit = common_unit(chain) if maker.unit < 0 else maker.unit
    exact = bool(unit) and slot_bytes == unit
    found = table_plans(maker.table(slot_bytes, count))
    if not exact:
        found += table_plans(maker.table(slot_bytes, count, nearest=True))
    least = measured.add(found)
    if found and any(stage.carried for stage in chain.stages):
        reach = max(measured.cost(s).heap_peak_bytes for s in found)
        if 0 < reach < 0.95 * top:
            wide, wide_count = maker.resolution(top * min(4.0, top / reach), slots)
            least = min(least, measured.add(table_plans(maker.table(wide, wide_count))))
    if math.isfinite(least) and not exact:
        low, low_count = maker.resolution(max(1.0, LEAST_MARGIN * least), slots)
        if low >= slot_bytes:
            return exact  # no finer than the tables above: their plans already
        measured.add(table_plans(maker.table(low, low_count)))
        measured.add(table_plans(maker.table(low, low_count, nearest=True)))
    return exact


def optimal_candidates(makers: list[TableMaker], slots: int) -> Callable[[Measured], bool]:
    """The candidates of ``optimal``/``blocks``: every maker's table plans (exact when there is
    one maker and its tables are)."""

    def make(measured: Measured) -> bool:
        exact = len(makers) == 1
        for maker in makers:
            within = min(slots, max(MIN_SLOTS, max_slots(maker.stages)))
            exact = maker_plans(maker, within, measured) and exact
        return exact

    return make


def family_candidates(family: Callable[[], list[Schedule]]) -> Callable[[Measured], bool]:
    """The candidates of a strategy with one knob: every value's plan (exact)."""

    def make(measured: Measured) -> bool:
        measured.add(family())
        return True

    return make
