"""Revolve: binomial checkpointing (Griewank & Walther 2000) for homogeneous chains.

With ``s`` checkpoint slots (the input takes one, as in pyrevolve) and ``l`` stages, reversing the
chain needs at least ``p(l, s) = r·l - C(s + r, s + 1)`` forward steps, where
``r = min{r : C(s + r, s) >= l}`` is the number of times the busiest stage is run. The forward
that precedes each backward is fused with it and not counted (pyrevolve's ``numforw``).

The schedule is built by the classical recursion: advance ``m`` stages from a checkpoint, store
``a[m]`` in a free slot, reverse the right part with one slot fewer, then the left part with the
slot back. An ``m`` that splits optimally is found in O(1) from binomials: every stage of the left
part may run ``r - 1`` times and every stage of the right part ``r`` times, and a stage costs the
same on either side once the left part holds ``β(s, r-2)`` stages and the right ``β(s-1, r-1)``,
where ``β(s, r) = C(s + r, s)``; so take ``m = max(1, β(s, r-2), l - β(s-1, r))``.
"""

from __future__ import annotations

from math import comb

import numpy as np

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Op, Schedule
from edgetrain.errors import InvalidInput

MAX_OPERATIONS = 50_000_000
"""Longest schedule revolve will build (about 1 GB of operations would be beyond any use)."""


def beta(slots: int, reps: int) -> int:
    """``β(s, r) = C(s + r, s)``: the most stages ``s`` slots can reverse running none > r times."""
    return comb(slots + reps, slots) if reps >= 0 else 0


def repetitions(steps: int, slots: int, start: int = 0) -> int:
    """``r = min{r >= start : β(slots, r) >= steps}``, by doubling then bisection (β grows with
    r: one slot needs r = steps - 1, which a search step by step took hours to reach)."""
    if beta(slots, start) >= steps:
        return start
    low, high = start, max(2 * start, 1)  # β(slots, low) < steps
    while beta(slots, high) < steps:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if beta(slots, middle) >= steps:
            high = middle
        else:
            low = middle
    return high


def optimal_forward_steps(steps: int, slots: int) -> int:
    """``p(l, s) = r·l - C(s + r, s + 1)``: the fewest forward steps revolve can do."""
    _check(steps, slots)
    reps = repetitions(steps, slots)
    return reps * steps - comb(slots + reps, slots + 1)


def split(steps: int, slots: int, reps: int) -> int:
    """How many stages to advance before storing the next checkpoint (see the module docstring)."""
    return max(1, beta(slots, reps - 2), steps - beta(slots - 1, reps))


def _check(steps: int, slots: int) -> None:
    if steps < 1:
        raise InvalidInput(f"steps must be at least 1, got {steps}")
    if slots < 1:
        raise InvalidInput(f"slots must be at least 1 (the input takes one), got {slots}")


def revolve(chain: Chain, slots: int) -> Schedule:
    """The binomial schedule for ``chain`` with ``slots`` checkpoint slots (input included)."""
    return revolve_steps(chain.length, slots)


def revolve_steps(steps: int, slots: int) -> Schedule:
    """The binomial schedule for ``steps`` stages and ``slots`` slots, without building a chain."""
    _check(steps, slots)
    if 3 * steps > MAX_OPERATIONS:  # a forward, a backward and a discard per stage at least
        raise InvalidInput(
            f"{steps} steps need more than {MAX_OPERATIONS} operations; plan at most "
            f"{MAX_OPERATIONS // 3} steps"
        )
    slots = min(slots, steps)  # more slots than stages change nothing
    forward = optimal_forward_steps(steps, slots)
    if forward + 3 * steps > MAX_OPERATIONS:
        raise InvalidInput(
            f"{steps} steps with {slots} slots need {forward} forward steps; "
            "give more slots (each one cuts the recomputation sharply)"
        )
    kinds: list[int] = []
    indices: list[int] = []
    fc, fn, fa, bw, ds = (
        int(op)
        for op in (
            Op.FORWARD_CHECKPOINT,
            Op.FORWARD_NOSAVE,
            Op.FORWARD_ALL,
            Op.BACKWARD,
            Op.DISCARD,
        )
    )

    def advance(start: int, count: int) -> None:
        """Forward ``count`` stages from the checkpoint ``a[start]``, keeping it."""
        kinds.append(fc)
        indices.append(start)
        kinds.extend([fn] * (count - 1))
        indices.extend(range(start + 1, start + count))

    def turn(k: int) -> None:
        """Run stage ``k`` with grad and backpropagate through it."""
        kinds.append(fa)
        indices.append(k)
        if k + 1 < steps:  # the recomputed a[k+1] is only the graph's business
            kinds.append(ds)
            indices.append(k + 1)
        kinds.append(bw)
        indices.append(k)

    snapshots = 0
    # Explicit stack of ranges to reverse: (start, steps, slots, reps bound).
    stack = [(0, steps, slots, repetitions(steps, slots))]
    while stack:
        start, length, free, reps = stack.pop()
        if length == 1:
            turn(start)
        elif free == 1:
            for offset in range(length - 1, 0, -1):
                advance(start, offset)
                turn(start + offset)
            turn(start)
        else:
            reps = _tighten(length, free, reps)
            m = split(length, free, reps)
            advance(start, m)
            snapshots += 1
            # Reverse the right part first (it is popped first), then the left one.
            stack.append((start, m, free, reps))
            stack.append((start + m, length - m, free - 1, reps))
    schedule = Schedule(
        length=steps,
        kinds=np.asarray(kinds, dtype=np.int8),
        indices=np.asarray(indices, dtype=np.int64),
        strategy="revolve",
        params={"slots": slots, "snapshots": snapshots},
    )
    return schedule


def _tighten(steps: int, slots: int, bound: int) -> int:
    """``repetitions(steps, slots)`` knowing it is at most ``bound`` (cheap: a few steps down)."""
    reps = bound
    while reps > 0 and beta(slots, reps - 1) >= steps:
        reps -= 1
    return reps
