"""The optimal checkpointing schedule for a heterogeneous chain: a dynamic program after rotor.

Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova (2019), "Optimal checkpointing for heterogeneous
chains: how to train deep neural networks with limited memory". For every sub-chain ``s..t``, every
memory size ``m`` (in slots of ``slot_bytes``), and whether ``a[s]``'s storage is also held outside
the sub-chain (*pinned*: the graph of stage ``s-1`` saved it as its output) or only by our
reference (*unpinned*), the table holds the least time to backpropagate through ``s..t`` given
``a[s]`` and the gradient of ``a[t+1]``, within ``m``. The two ways to start:

* **graph first**: ``Fa s``, then the sub-chain ``s+1..t`` (pinned when stage ``s`` saves its
  output), then ``B s``;
* **checkpoint**: ``Fc s``, ``Fn s+1 .. j-1``, the sub-chain ``j..t`` (owning ``a[j]``), then the
  sub-chain ``s..j-1`` again from ``a[s]`` — for the best ``j``;
* **release** (beyond rotor): ``Fc s``, ``Fr s+1`` (stage ``s+1``'s graph without its input),
  the sub-chain ``s+2..t``, then ``Fa s`` (which gives ``a[s+1]`` back), ``B s+1``, ``B s``.
  Stage ``s+1``'s input is rebuilt by running stage ``s`` again, not by running ``s+1`` again:
  what ``torch.compile``'s partitioner does when it keeps a matrix product's input's producer's
  input and recomputes the cheap operation (GELU, LayerNorm, BatchNorm and ReLU) between them.

The recursion reads its stages' costs from :class:`StepCosts`, where running a stage "graph
first" may be one of several *options* (its forward phase, what it leaves held, its backward
phase) and the best is taken: a chain's own stages have one option each (:func:`chain_costs`),
blocks of stages several (:mod:`edgetrain.planners.blocks`, through :class:`TableMaker`).

Memory is counted exactly as :func:`edgetrain.core.simulator.simulate` counts it (a graph holds what
autograd saves: its input, its output or neither; shared storages once; transient peaks per
operation; the output held by the caller after the loss; parameter gradients held from the backward
that creates them to the end of the step), with every size rounded *up* to whole slots, so a plan
that fits in the table fits in reality; :func:`~edgetrain.planners.optimal.optimal` also tries
the table's plans for budgets a little above the one asked for, which rounding may have priced
out, checking each with the simulator. The table is filled one span at a time by a compiled kernel
(:mod:`edgetrain.planners.dp_kernels`, numba), which also reads each plan back, working out the
choice behind each cell it visits again from the same numbers (the fill keeps only the times).

The work is about ``L**3 / 3 * slots`` operations, so long chains get fewer slots (never fewer than
:data:`MIN_SLOTS`): the plan is then optimal at a coarser memory resolution, and still fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Op, Schedule
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.planners.step_costs import StepCosts, chain_costs

DEFAULT_SLOTS = 500
MIN_SLOTS = 48
WORK_LIMIT = 1.2e8
"""Table cells times split points the planner fills at most (a tenth of a second compiled)."""
TABLE_LIMIT_BYTES = 2**30
"""Largest table the planner builds, at 24 bytes a sub-chain and slot (the times of both pins and
the reach rows, of which only the sub-chains ``t >= s`` are touched; choices only for the rows a
plan reads)."""


def max_slots(length: int) -> int:
    """The most memory slots a table for a chain of ``length`` stages may have."""
    by_work = int(WORK_LIMIT / max(1.0, length**3 / 3))
    by_size = TABLE_LIMIT_BYTES // (2 * length * length * 12) - 1
    return max(1, min(max(MIN_SLOTS, by_work), by_size))


_OPS = {int(op): op for op in Op}


Expand = Callable[[list[tuple[Op, int, int]]], list[tuple[Op, int]]]
"""Turns the recursion's operations ``(op, stage, option)`` into the chain's ``(op, index)``."""


class OptimalTable:
    """The filled dynamic-programming table for one chain and one slot size.

    ``time(m)`` is the least time of a whole training step within ``m`` slots; ``schedule(m)`` the
    plan that achieves it. One table answers every budget up to ``slots`` slots. Sizes are rounded
    up (a plan always fits its budget) or, with ``nearest``, to the nearest slot (errors cancel
    along long chains of small stages, and the plans must be checked with the simulator).

    By default the recursion's stages are the chain's (:func:`chain_costs`); ``costs`` gives
    other ones (blocks of stages with several options each, see
    :mod:`edgetrain.planners.blocks`), and ``expand`` turns their operations into the chain's.
    ``release=False``: rotor's recursion alone, without the *release* start.
    """

    def __init__(
        self,
        chain: Chain,
        slot_bytes: float,
        slots: int,
        *,
        grads_exist: bool = False,
        nearest: bool = False,
        costs: Callable[[float, bool], StepCosts] | None = None,
        expand: Expand | None = None,
        strategy: str = "optimal",
        release: bool = True,
    ) -> None:
        if slot_bytes <= 0 or slots < 1:
            raise InvalidInput("the memory budget must be positive; give e.g. --memory 512MB")
        self.chain = chain
        self.slot_bytes = float(slot_bytes)
        self.slots = int(slots)
        self.grads_exist = grads_exist
        self.strategy = strategy
        self._expand = expand
        if costs is None:
            self._z = chain_costs(chain, self.slot_bytes, grads_exist, nearest)
        else:
            self._z = costs(self.slot_bytes, nearest)
        if not release:  # rotor's recursion alone
            self._z = replace(self._z, pair_time=None)
        z = self._z
        n = self.length = z.length
        if 2 * n * n * (slots + 1) * 12 > TABLE_LIMIT_BYTES:
            raise InvalidInput(
                f"a table of {slots} slots for {n} stages would exceed "
                f"{TABLE_LIMIT_BYTES >> 20} MiB; use at most {max_slots(n)} slots"
            )
        size = self.slots + 1
        least = _least_times(z)
        # NOTE [lazy kernel]: numba's import (about 0.3 s) is paid by a process that builds a
        # table, not by every ``import edgetrain`` (the CLI, a board that only runs a plan).
        from edgetrain.planners.dp_kernels import fill, pack

        self._costs = pack(z, least)
        # tab[pin, s, t, m] (the sub-chain s..t; only t >= s is written or read), reach[t, j, m]
        # and first[pin, s, t]: see dp_kernels.
        self._time = np.empty((2, n, n, size))
        self._table = (self._time, np.empty((n, n, size)), np.empty((2, n, n), dtype=np.int64))
        fill(self._costs, self._table)
        # The choices behind a row's cells, worked out again from the same numbers when a plan
        # is read (the fill takes a minimum, not an argmin), and kept: chosen[pin, s, t] once
        # known[pin, s, t].
        self._chosen = np.empty((2, n, n, size), dtype=np.int32)
        self._known = np.zeros((2, n, n), dtype=bool)

    # -- queries -----------------------------------------------------------------------------------

    def time(self, slots: int) -> float:
        """Least time (seconds) of a step within ``slots`` slots (inf if none fits)."""
        return float(self._time[1, 0, self.length - 1, min(slots, self.slots)])

    def times(self) -> np.ndarray:
        """Least step time for every budget 0..slots (inf where none fits)."""
        row: np.ndarray = self._time[1, 0, self.length - 1].copy()
        return row

    def smallest_feasible_slots(self) -> int | None:
        """Fewest slots any plan needs, or None if even ``slots`` is too few."""
        finite = np.flatnonzero(np.isfinite(self.times()))
        return int(finite[0]) if finite.size else None

    def operations(self, slots: int) -> list[tuple[Op, int, int]]:
        """The optimal plan within ``slots`` slots as the recursion's operations ``(op, stage,
        option)`` (the option of an ``Fa`` and its ``B``; 0 otherwise)."""
        kinds, stages, options = self._read(slots)
        return list(zip(map(_OPS.__getitem__, kinds), stages, options, strict=True))

    def _read(self, slots: int) -> tuple[list[int], list[int], list[int]]:
        """:meth:`operations` as three lists: kinds (:class:`Op` values), stages, options."""
        slots = min(slots, self.slots)
        if not np.isfinite(self._time[1, 0, self.length - 1, slots]):
            raise InfeasibleBudget(f"no plan fits in {slots} slots", None)
        from edgetrain.planners.dp_kernels import read  # see NOTE [lazy kernel]

        kinds, stages, options = read(self._costs, self._table, self._chosen, self._known, slots)
        return kinds.tolist(), stages.tolist(), options.tolist()

    def schedule(self, slots: int, params: dict[str, object] | None = None) -> Schedule:
        """The optimal plan within ``slots`` slots, as a schedule of the chain."""
        slots = min(slots, self.slots)
        info: dict[str, object] = {"budget_bytes": int(slots * self.slot_bytes), "slots": slots}
        info.update(params or {})
        if self._expand is None:  # the chain's own stages
            kinds, stages, _ = self._read(slots)
            return Schedule(
                self.chain.length,
                np.array(kinds, dtype=np.int8),
                np.array(stages, dtype=np.int64),
                self.strategy,
                info,
            )
        ops = self._expand(self.operations(slots))
        return Schedule.from_ops(self.chain.length, ops, self.strategy, info)


def _least_times(z: StepCosts) -> np.ndarray | None:
    """``least[d, s]``: the least time of the sub-chain ``s..s+d``, every stage once with its
    fastest option, summed in the order the recursion sums graph-first starts (None where
    some time is negative: no such bound)."""
    fastest = np.min(z.opt_time, axis=0)
    if np.any(z.fwd_time < 0) or np.any(fastest < 0):
        return None
    n = len(fastest)
    least = np.full((n, n), np.inf)
    least[0] = fastest
    for d in range(1, n):
        least[d, : n - d] = fastest[: n - d] + least[d - 1, 1 : n - d + 1]
    return least
