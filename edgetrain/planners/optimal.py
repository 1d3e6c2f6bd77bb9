"""The optimal checkpointing schedule for a heterogeneous chain: a dynamic program after rotor.

Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova (2019), "Optimal checkpointing for heterogeneous
chains: how to train deep neural networks with limited memory". For every sub-chain ``s..t``, every
memory size ``m`` (in slots of ``slot_bytes``), and whether the sub-chain owns its input ``a[s]``
(*unpinned*: it may drop it) or the input is held by an enclosing graph (*pinned*), the table holds
the least time to backpropagate through ``s..t`` given ``a[s]`` and the gradient of ``a[t+1]``,
within ``m``. The two ways to start:

* **graph first**: ``Fa s``, then the sub-chain ``s+1..t`` (pinned: the graph holds ``a[s+1]``),
  then ``B s``;
* **checkpoint**: ``Fc s``, ``Fn s+1 .. j-1``, the sub-chain ``j..t`` (owning ``a[j]``), then the
  sub-chain ``s..j-1`` again from ``a[s]`` — for the best ``j``.

Memory is counted exactly as :func:`edgetrain.schedule.simulate` counts it (shared storages once,
transient peaks per operation, the output held by the caller after the loss), with every size
rounded *up* to whole slots, so a plan that fits in the table fits in reality. The table is filled
with numpy one sub-chain at a time, vectorised over memory sizes and split points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgetrain.chain import Chain
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.schedule import Op, Schedule, simulate

DEFAULT_SLOTS = 500
TABLE_LIMIT_BYTES = 2**30
"""Largest table (time and choice arrays) the planner builds; longer chains get fewer slots."""


def max_slots(length: int) -> int:
    """The most memory slots a table for a chain of ``length`` stages may have."""
    return max(16, TABLE_LIMIT_BYTES // (2 * length * length * 12) - 1)


@dataclass(frozen=True)
class _Sizes:
    """The chain's sizes in slots, rounded up, and its times."""

    act: np.ndarray  # a[k], k = 0..L (a[0] = 0: held by the caller)
    grad: np.ndarray  # gradient of a[k]
    extra: np.ndarray  # saved_bytes of stage k
    saves_input: np.ndarray  # bool
    fwd_peak: np.ndarray  # forward without grad
    fwd_grad_peak: np.ndarray  # forward with grad
    bwd_peak: np.ndarray
    fwd_time: np.ndarray
    bwd_time: np.ndarray


def _sizes(chain: Chain, slot_bytes: float) -> _Sizes:
    def up(values: list[int]) -> np.ndarray:
        return np.array([math.ceil(v / slot_bytes) for v in values], dtype=np.int64)

    stages = chain.stages
    n = chain.length
    return _Sizes(
        act=up([0] + [s.output_bytes for s in stages]),
        grad=up([chain.gradient_of_activation_bytes(k) for k in range(n + 1)]),
        extra=up([s.saved_bytes for s in stages]),
        saves_input=np.array([s.saves_input for s in stages], dtype=bool),
        fwd_peak=up([s.forward_peak_bytes for s in stages]),
        fwd_grad_peak=up([s.forward_grad_peak_bytes for s in stages]),
        bwd_peak=up([s.backward_peak_bytes for s in stages]),
        fwd_time=np.array([s.forward_seconds for s in stages], dtype=np.float64),
        bwd_time=np.array([s.backward_seconds for s in stages], dtype=np.float64),
    )


class OptimalTable:
    """The filled dynamic-programming table for one chain and one slot size.

    ``time(m)`` is the least time of a whole training step within ``m`` slots; ``schedule(m)`` the
    plan that achieves it. One table answers every budget up to ``slots`` slots.
    """

    def __init__(self, chain: Chain, slot_bytes: float, slots: int) -> None:
        if slot_bytes <= 0 or slots < 1:
            raise InvalidInput("the memory budget must be positive; give e.g. --memory 512MB")
        if slots > max_slots(chain.length):
            raise InvalidInput(
                f"a table of {slots} slots for {chain.length} stages would exceed "
                f"{TABLE_LIMIT_BYTES >> 20} MiB; use at most {max_slots(chain.length)} slots"
            )
        self.chain = chain
        self.slot_bytes = float(slot_bytes)
        self.slots = int(slots)
        self._z = _sizes(chain, self.slot_bytes)
        n = chain.length
        size = self.slots + 1
        # time[pin, s, t, m] and choice[pin, s, t, m]: -1 = graph first, j = checkpoint at j.
        self._time = np.full((2, n, n, size), np.inf)
        self._choice = np.full((2, n, n, size), -2, dtype=np.int32)
        self._fill()

    # -- the recursion -----------------------------------------------------------------------------

    def _fill(self) -> None:
        z = self._z
        n = self.chain.length
        m = np.arange(self.slots + 1)
        prefix = np.concatenate([[0.0], np.cumsum(z.fwd_time)])
        act_out = z.act[n]  # held by the caller after the loss
        for span in range(n):
            for s in range(n - span):
                t = s + span
                top = t == n - 1
                grad_in = 0 if top else z.grad[t + 1]  # gradient present on entry
                after = act_out if top else 0  # what stays held once s..t is done (besides grad)
                for pin in (0, 1):
                    own = 0 if pin else z.act[s]
                    graph = z.act[s + 1] + z.extra[s] + (0 if pin else z.saves_input[s] * z.act[s])
                    # Graph first (or the base case): Fa s, [sub-chain s+1..t pinned], B s.
                    peak_f = own + grad_in + z.fwd_grad_peak[s]
                    if span == 0:
                        peak_b = graph + z.grad[s + 1] + z.bwd_peak[s]
                        best = np.where(
                            m >= max(peak_f, peak_b), z.fwd_time[s] + z.bwd_time[s], np.inf
                        )
                    else:
                        peak_b = graph + z.grad[s + 1] + after + z.bwd_peak[s]
                        inner = _shift(self._time[1, s + 1, t], graph)
                        best = np.where(
                            m >= max(peak_f, peak_b), z.fwd_time[s] + inner + z.bwd_time[s], np.inf
                        )
                    choice = np.full(m.shape, -1, dtype=np.int32)
                    if span > 0:
                        # Checkpoint at j: Fc s, Fn s+1..j-1, then j..t (owning a[j]), then s..j-1.
                        js = np.arange(s + 1, t + 1)
                        walk = np.maximum.accumulate(
                            np.concatenate(
                                [[z.fwd_peak[s]], z.act[s + 1 : t] + z.fwd_peak[s + 1 : t]]
                            )
                        )
                        peak_walk = own + grad_in + walk  # walk[j - s - 1]: peak of reaching a[j]
                        right = _shift_rows(self._time[0, s + 1 : t + 1, t], own)
                        left = _shift_rows(self._time[pin, s, s:t], after)
                        cand = (prefix[js] - prefix[s])[:, None] + right + left
                        cand = np.where(m[None, :] >= peak_walk[:, None], cand, np.inf)
                        pick = np.argmin(cand, axis=0)
                        value = cand[pick, m]
                        better = value < best
                        best = np.where(better, value, best)
                        choice = np.where(better, js[pick], choice)
                    self._time[pin, s, t] = best
                    self._choice[pin, s, t] = np.where(np.isfinite(best), choice, -2)

    # -- queries -----------------------------------------------------------------------------------

    def time(self, slots: int) -> float:
        """Least time (seconds) of a step within ``slots`` slots (inf if none fits)."""
        return float(self._time[1, 0, self.chain.length - 1, min(slots, self.slots)])

    def times(self) -> np.ndarray:
        """Least step time for every budget 0..slots (inf where none fits)."""
        row: np.ndarray = self._time[1, 0, self.chain.length - 1].copy()
        return row

    def smallest_feasible_slots(self) -> int | None:
        """Fewest slots any plan needs, or None if even ``slots`` is too few."""
        finite = np.flatnonzero(np.isfinite(self.times()))
        return int(finite[0]) if finite.size else None

    def schedule(self, slots: int, params: dict[str, object] | None = None) -> Schedule:
        """The optimal plan within ``slots`` slots."""
        n = self.chain.length
        slots = min(slots, self.slots)
        if not np.isfinite(self._time[1, 0, n - 1, slots]):
            raise InfeasibleBudget(f"no plan fits in {slots} slots", None)
        z = self._z
        act_out = int(z.act[n])
        ops: list[tuple[Op, int]] = []
        # Explicit stack: ("solve", pin, s, t, m) or ("emit", op, index).
        stack: list[tuple[object, ...]] = [("solve", 1, 0, n - 1, slots)]
        while stack:
            item = stack.pop()
            if item[0] == "emit":
                ops.append((item[1], item[2]))  # type: ignore[arg-type]
                continue
            _, pin, s, t, m = item
            assert isinstance(pin, int) and isinstance(s, int) and isinstance(t, int)
            assert isinstance(m, int)
            j = int(self._choice[pin, s, t, m])
            after = act_out if t == n - 1 else 0
            if j == -1:
                graph = int(z.act[s + 1] + z.extra[s] + (0 if pin else z.saves_input[s] * z.act[s]))
                todo: list[tuple[object, ...]] = [("emit", Op.FORWARD_ALL, s)]
                if not pin and s > 0:
                    todo.append(("emit", Op.DISCARD, s))
                if t > s:
                    todo.append(("solve", 1, s + 1, t, m - graph))
                todo.append(("emit", Op.BACKWARD, s))
            else:
                own = 0 if pin else int(z.act[s])
                todo = [("emit", Op.FORWARD_CHECKPOINT, s)]
                todo += [("emit", Op.FORWARD_NOSAVE, k) for k in range(s + 1, j)]
                todo += [("solve", 0, j, t, m - own), ("solve", pin, s, j - 1, m - after)]
            stack.extend(reversed(todo))
        info: dict[str, object] = {"budget_bytes": int(slots * self.slot_bytes), "slots": slots}
        info.update(params or {})
        return Schedule.from_ops(n, ops, "optimal", info)


def store_all(chain: Chain) -> Schedule:
    """Plain autograd as a plan: every stage forward with its graph, then every backward."""
    n = chain.length
    ops = [(Op.FORWARD_ALL, k) for k in range(n)] + [(Op.BACKWARD, k) for k in reversed(range(n))]
    return Schedule.from_ops(n, ops, "optimal", {"budget_bytes": None})


def _shift(values: np.ndarray, offset: int) -> np.ndarray:
    """``out[m] = values[m - offset]`` (inf where ``m < offset``): what is left after ``offset``."""
    offset = int(offset)
    if offset <= 0:
        return values.copy()
    out = np.full_like(values, np.inf)
    if offset < values.shape[-1]:
        out[offset:] = values[: values.shape[-1] - offset]
    return out


def _shift_rows(values: np.ndarray, offset: int) -> np.ndarray:
    """:func:`_shift` applied to every row of a 2-D array."""
    offset = int(offset)
    if offset <= 0:
        return values
    out = np.full_like(values, np.inf)
    if offset < values.shape[-1]:
        out[:, offset:] = values[:, : values.shape[-1] - offset]
    return out


def optimal(chain: Chain, memory_bytes: float, slots: int = DEFAULT_SLOTS) -> Schedule:
    """The fastest plan whose peak stays within ``memory_bytes`` (activations, see simulate).

    The budget is cut into ``slots`` slots and sizes are rounded up to whole slots, so the table's
    plan always fits. Rounding can also hide plans that would fit exactly; to win them back the
    table is also filled for slightly larger budgets (keeping a plan only if its exact simulated
    peak fits), and the checkpoint_sequential and revolve plans that fit are considered too: the
    result is never slower than any of them. Raises :class:`InfeasibleBudget` (with the smallest
    budget that works at this resolution) when no plan fits.
    """
    if memory_bytes <= 0:
        raise InvalidInput("the memory budget must be positive; give e.g. 512MB")
    slots = min(slots, max_slots(chain.length))
    schedule = _fastest_within(chain, memory_bytes, slots)
    if schedule is None:
        smallest = minimum_memory(chain, slots)
        raise InfeasibleBudget(
            f"no plan fits in {memory_bytes:.0f} bytes; the smallest that works is "
            f"{smallest:.0f} bytes",
            smallest,
        )
    return schedule


def _fastest_within(chain: Chain, memory_bytes: float, slots: int) -> Schedule | None:
    """:func:`optimal`'s search; None when nothing fits."""
    everything = store_all(chain)
    if simulate(chain, everything).peak_bytes <= memory_bytes:
        return everything  # nothing is faster than storing everything
    best: tuple[float, Schedule] | None = None
    for inflate in (0.0, 0.25, 0.5, 1.0, 2.0, 4.0):
        budget = memory_bytes * (1 + inflate * chain.length / slots / 4)
        table = OptimalTable(chain, budget / slots, slots)
        if not np.isfinite(table.time(slots)):
            continue
        schedule = table.schedule(slots)
        cost = simulate(chain, schedule)
        if cost.peak_bytes <= memory_bytes and (best is None or cost.seconds < best[0]):
            best = (cost.seconds, schedule)
    for schedule in _classic_plans(chain):
        cost = simulate(chain, schedule)
        if cost.peak_bytes <= memory_bytes and (best is None or cost.seconds < best[0] - 1e-12):
            best = (cost.seconds, schedule)
    if best is None:
        return None
    schedule = best[1]
    params = {**schedule.params, "budget_bytes": int(memory_bytes), "from": schedule.strategy}
    return Schedule(schedule.length, schedule.kinds, schedule.indices, "optimal", params)


def _classic_plans(chain: Chain) -> list[Schedule]:
    """checkpoint_sequential's plans for every segment count and revolve's for every slot count."""
    from edgetrain.planners.revolve import revolve
    from edgetrain.planners.sequential import sequential

    n = chain.length
    return [
        *(sequential(chain, s) for s in range(1, n + 1)),
        *(revolve(chain, s) for s in range(1, n + 1)),
    ]


def minimum_memory(chain: Chain, slots: int = DEFAULT_SLOTS) -> float:
    """The smallest activation budget (bytes) with which :func:`optimal` finds a plan.

    Starts from the store-everything peak (always feasible) and repeatedly asks the table, at the
    resolution of the current answer, for the fewest slots that work; a candidate is accepted only
    if :func:`optimal` succeeds with it at its own resolution, so the answer is always usable.
    """
    slots = min(slots, max_slots(chain.length))
    best = float(simulate(chain, store_all(chain)).peak_bytes)
    for _ in range(6):
        fewest = OptimalTable(chain, best / slots, slots).smallest_feasible_slots()
        if fewest is None:
            break
        improved = False
        for widen in range(4):  # a coarser or finer grid rounds differently: allow a little room
            candidate = fewest * best / slots * (1 + widen / slots)
            if candidate < best and _feasible(chain, candidate, slots):
                best, improved = candidate, True
                break
        if not improved:
            break
    return best


def _feasible(chain: Chain, budget: float, slots: int) -> bool:
    return _fastest_within(chain, budget, slots) is not None
