"""The compiled kernel of the dynamic program (:mod:`edgetrain.planners.dp_table`): one row of
the table (a sub-chain ``s..t`` at every memory size), filled or with the choices behind it.

Compiled by numba on first use and kept in its cache (:func:`compiled`): a machine pays the
compile once (about 12 s of CPU), each process a load from the cache (about 0.5 s). One loop per
candidate start over the memory sizes, no temporaries: a 130-stage table of 164 slots (120
million candidate cells) fills in under a tenth of a second.

The costs come packed (:func:`pack`) as ``ints[row, k]`` (rows :data:`ACT`, :data:`GRAD`,
:data:`HELD`, :data:`FIRST`, :data:`STEP`), ``opts[o, row, s]`` per option (rows
:data:`O_FWD`, :data:`O_GRAPH`, :data:`O_BWD` each ``+ pin``, :data:`O_PINS`, :data:`O_EXISTS`),
``opt_time[o, s]``, ``pair[row, s]`` for the *release* start (rows :data:`P_FWD`,
:data:`P_HELD`, :data:`P_BWD` each ``+ pin``, :data:`P_PINS`), ``pair_time[s]`` (inf: no such
start), ``prefix[k]`` (forward seconds before stage k) and ``least[d, s]`` (the least time of
``s..s+d`` any plan takes; no rows: no such bound). The table is ``tab[pin, s, t, m]`` (the
least time of ``s..t`` within ``m`` slots), ``reach[t, j, m] = tab[0, j, t, m] + prefix[j]``
(rows by their end: a checkpoint's candidates are consecutive rows) and ``first[pin, s, t]``
(each row's first finite slot; the rows are non-increasing in ``m``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np

from edgetrain.core.schedule import Op
from edgetrain.planners.step_costs import StepCosts

ACT, GRAD, HELD, FIRST, STEP = range(5)
O_FWD, O_GRAPH, O_BWD, O_PINS, O_EXISTS = 0, 2, 4, 6, 7
P_FWD, P_HELD, P_BWD, P_PINS = 0, 2, 4, 6
FN, FC, FA = int(Op.FORWARD_NOSAVE), int(Op.FORWARD_CHECKPOINT), int(Op.FORWARD_ALL)
FR, B, D = int(Op.FORWARD_RELEASE), int(Op.BACKWARD), int(Op.DISCARD)
_SOLVE, _EMIT = 0, 1

INF = np.inf
TIE = 1 - 1e-12
"""A checkpoint's time must be below this share of a start's with fewer operations to win."""
SATURATED = 1 + 1e-13
"""Where a row's time is within this share of the least any plan takes, no checkpoint wins."""

Costs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""``(ints, opts, opt_time, pair, pair_time, prefix, least)``."""
Table = tuple[np.ndarray, np.ndarray, np.ndarray]
"""``(tab, reach, first)``."""

F = TypeVar("F", bound=Callable[..., Any])


def compiled(function: F) -> F:
    """``function`` compiled by numba (no Python objects inside), its machine code cached in
    the first writable place of ``NUMBA_CACHE_DIR``, ``__pycache__`` beside this file and the
    user's cache directory; where none is writable, compiled in each process."""
    try:
        return cast(F, numba.njit(cache=True, nogil=True)(function))
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return cast(F, numba.njit(nogil=True)(function))


def pack(z: StepCosts, least: np.ndarray | None) -> Costs:
    """The costs as the kernel reads them (see the module docstring; ``least`` None: no
    bound)."""
    n = z.length
    ints = np.zeros((5, n + 1), dtype=np.int64)
    ints[ACT], ints[GRAD], ints[HELD] = z.act, z.grad, z.held_grads
    ints[FIRST, :n], ints[STEP, :n] = z.first, z.step
    options = z.opt_time.shape[0]
    opts = np.zeros((options, 8, n), dtype=np.int64)
    opts[:, O_FWD : O_FWD + 2] = z.opt_fwd_peak
    opts[:, O_GRAPH : O_GRAPH + 2] = z.opt_graph
    opts[:, O_BWD : O_BWD + 2] = z.opt_bwd_peak
    opts[:, O_PINS] = z.opt_pins
    exists = np.isfinite(z.opt_time)
    exists[0] = True  # option 0 always, so that no stage has none
    opts[:, O_EXISTS] = exists
    pair = np.zeros((7, n), dtype=np.int64)
    pair_time = np.full(n, np.inf)
    if z.pair_time is not None:
        assert z.pair_fwd_peak is not None and z.pair_held is not None
        assert z.pair_bwd_peak is not None and z.pair_pins is not None
        pair[P_FWD : P_FWD + 2] = z.pair_fwd_peak
        pair[P_HELD : P_HELD + 2] = z.pair_held
        pair[P_BWD : P_BWD + 2] = z.pair_bwd_peak
        pair[P_PINS] = z.pair_pins
        pair_time[:] = z.pair_time
    prefix = np.concatenate([[0.0], np.cumsum(z.fwd_time)])
    bound = np.empty((0, n)) if least is None else np.ascontiguousarray(least, dtype=np.float64)
    opt_time = np.ascontiguousarray(z.opt_time, dtype=np.float64)
    return ints, opts, opt_time, pair, pair_time, prefix, bound


@compiled
def fill(costs: Costs, table: Table) -> None:
    """Every sub-chain's least times into ``table``."""
    tab, reach, first = table
    prefix = costs[5]
    n = tab.shape[1]
    size = tab.shape[3]
    best = np.empty(size)
    acc = np.empty(size)
    choice = np.empty(0, dtype=np.int32)
    pick = np.empty(0, dtype=np.int64)
    # Each sub-chain after every sub-chain inside it: by start descending, then end ascending,
    # so that the rows a start's candidates read again (its own, s..j-1) stay in the cache.
    for s in range(n - 1, -1, -1):
        for t in range(s, n):
            for pin in range(2):
                _row(costs, table, pin, s, t, False, best, choice, acc, pick)
                tab[pin, s, t] = best
                found = size
                for m in range(size):
                    if best[m] < INF:
                        found = m
                        break
                first[pin, s, t] = found
                if pin == 0:
                    reach[t, s] = best + prefix[s]


@compiled
def _row(
    costs: Costs,
    table: Table,
    pin: int,
    s: int,
    t: int,
    choose: bool,
    best: np.ndarray,
    choice: np.ndarray,
    acc: np.ndarray,
    pick: np.ndarray,
) -> None:
    """Least times of sub-chain ``s..t`` for every memory size into ``best`` (with ``choose``
    the choices into ``choice``): graph first, release, then checkpoints."""
    ints, opts, opt_time, _, pair_time, prefix, least = costs
    tab = table[0]
    n = tab.shape[1]
    size = tab.shape[3]
    span = t - s
    top = t == n - 1
    act = ints[ACT]
    grad_in = 0 if top else ints[GRAD, t + 1]
    after = ints[ACT, n] + ints[GRAD, n] if top else 0  # the caller's output and its gradient
    entry_rest = grad_in + ints[HELD, t + 1]
    left_b = ints[GRAD, s] + ints[HELD, s] + after
    best[:] = INF
    if choose:
        choice[:] = -1
    # Graph first with option o: its forward phase, the sub-chain s+1..t, its backward phase.
    for o in range(opts.shape[0]):
        if o > 0 and opts[o, O_EXISTS, s] == 0:
            continue
        peak_f = entry_rest + opts[o, O_FWD + pin, s]
        peak_b = ints[HELD, s + 1] + opts[o, O_BWD + pin, s] + (after if span > 0 else 0)
        lo = max(peak_f, max(peak_b, left_b), 0)
        base = opt_time[o, s]
        pinned = opts[o, O_PINS, s]
        shift = 0
        inner = tab[0, s, t]  # read only when span > 0
        if span > 0:
            shift = opts[o, O_GRAPH + pin, s] + pinned * act[s + 1]
            lo = max(lo, shift)
            inner = tab[pinned, s + 1, t]
        _start(base, inner, shift, lo, span == 0, choose, -1 - o, best, choice)
    if span > 0 and pair_time[s] < INF:
        code = -1 - opts.shape[0]
        _release(costs, tab, pin, s, t, entry_rest, after, left_b, choose, code, best, choice)
    if span == 0:
        return
    stop = size
    if not choose and not top and least.shape[0] > 0:
        floor = least[span, s] * SATURATED
        for m in range(size):
            if best[m] <= floor:
                stop = m
                break
    own = 0 if pin else act[s]
    _checkpoints(costs, table, pin, s, t, entry_rest, own, after, stop, choose, acc, pick)
    for m in range(stop):
        value = acc[m] - prefix[s]
        # Ties (to rounding) go to the start with fewer operations.
        if value < best[m] * TIE:
            best[m] = value
            if choose:
                choice[m] = s + pick[m]


@compiled
def _release(
    costs: Costs,
    tab: np.ndarray,
    pin: int,
    s: int,
    t: int,
    entry_rest: int,
    after: int,
    left_b: int,
    choose: bool,
    code: int,
    best: np.ndarray,
    choice: np.ndarray,
) -> None:
    """The *release* start of ``s..t`` (``Fc s``, ``Fr s+1``, the sub-chain ``s+2..t``,
    ``Fa s``, ``B s+1``, ``B s``) where it beats ``best`` (its choice: ``code``)."""
    ints, pair, pair_time = costs[0], costs[3], costs[4]
    n = tab.shape[1]
    span = t - s
    peak_f = entry_rest + pair[P_FWD + pin, s]
    peak_b = ints[HELD, min(s + 2, n)] + pair[P_BWD + pin, s] + (after if span > 1 else 0)
    lo = max(peak_f, max(peak_b, left_b), 0)
    base = pair_time[s]
    shift = 0
    inner = tab[0, s, t]  # read only when span > 1
    if span > 1:
        pinned = pair[P_PINS, s]
        shift = pair[P_HELD + pin, s] + pinned * ints[ACT, s + 2]
        lo = max(lo, shift)
        inner = tab[pinned, s + 2, t]
    _start(base, inner, shift, lo, span == 1, choose, code, best, choice)


@compiled
def _start(
    base: float,
    inner: np.ndarray,
    shift: int,
    lo: int,
    alone: bool,
    choose: bool,
    code: int,
    best: np.ndarray,
    choice: np.ndarray,
) -> None:
    """One way to start a sub-chain, taken at every memory size from ``lo`` where it beats
    ``best`` (its choice: ``code``): ``base`` seconds, plus, unless it runs the sub-chain
    ``alone``, the rest's least time ``shift`` slots below (``inner``)."""
    for m in range(lo, best.shape[0]):
        value = base if alone else base + inner[m - shift]
        if value < best[m]:
            best[m] = value
            if choose:
                choice[m] = code


@compiled
def _checkpoints(
    costs: Costs,
    table: Table,
    pin: int,
    s: int,
    t: int,
    entry_rest: int,
    own: int,
    after: int,
    stop: int,
    choose: bool,
    acc: np.ndarray,
    pick: np.ndarray,
) -> None:
    """``acc[m]`` for ``m < stop``: the least over splits ``j`` of starting with a checkpoint
    (``Fc s``, ``Fn`` up to ``a[j]``, the sub-chain ``j..t`` owning ``a[j]``, then ``s..j-1``
    again from ``a[s]``), plus the forward time before ``s``; with ``choose``, ``pick[m]``:
    the first best ``j - s``."""
    ints = costs[0]
    tab, reach, first = table
    n = tab.shape[1]
    acc[:stop] = INF
    if choose:
        pick[:stop] = 1
    walk = ints[FIRST, s]  # the peak of reaching a[j] from a[s], a[s] not counted
    for j in range(s + 1, t + 1):
        if j > s + 1:
            walk = max(walk, ints[STEP, min(j - 1, n - 1)])
        far = reach[t, j]  # j..t owning a[j], beside our a[s]
        near = tab[pin, s, j - 1]  # s..j-1 again, beside the caller's output when t is the last
        lo = max(own + entry_rest + walk, own + first[0, j, t], after + first[pin, s, j - 1], 0)
        if choose:
            for m in range(lo, stop):
                value = far[m - own] + near[m - after]
                if value < acc[m]:
                    acc[m] = value
                    pick[m] = j - s
        elif lo < stop:
            # Slices indexed from 0: the loop vectorises (no negative-index wrap-around).
            low, outer = acc[lo:stop], far[lo - own : stop - own]
            inner = near[lo - after : stop - after]
            for i in range(low.shape[0]):
                low[i] = min(low[i], outer[i] + inner[i])


@compiled
def read(
    costs: Costs, table: Table, chosen: np.ndarray, known: np.ndarray, slots: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plan of the whole chain within ``slots`` slots: its operations' kinds, stages and
    options (the option of an ``Fa`` and its ``B``; 0 otherwise). ``chosen[pin, s, t]``
    holds the choices behind a row (:func:`_row` with ``choose``) once ``known[pin, s, t]``."""
    ints, opts, pair = costs[0], costs[1], costs[3]
    n = table[0].shape[1]
    size = table[0].shape[3]
    act = ints[ACT]
    top_after = ints[ACT, n] + ints[GRAD, n]
    release = -1 - opts.shape[0]
    best, acc, pick = np.empty(size), np.empty(size), np.empty(size, dtype=np.int64)
    out = np.empty((4 * n, 3), dtype=np.int64)
    count = 0
    # An explicit stack of (SOLVE, pin, s, t, m) and (EMIT, kind, stage, option, 0), last first.
    stack = np.empty((4 * n, 5), dtype=np.int64)
    stack[0] = (_SOLVE, 1, 0, n - 1, slots)
    depth = 1
    while depth > 0:
        depth -= 1
        tag, a, b, c, m = stack[depth]
        if tag == _EMIT:
            out = _room(out, count + 1)
            out[count] = (a, b, c)
            count += 1
            continue
        pin, s, t = a, b, c
        if not known[pin, s, t]:
            _row(costs, table, pin, s, t, True, best, chosen[pin, s, t], acc, pick)
            known[pin, s, t] = True
        j = chosen[pin, s, t, m]
        stack = _room(stack, depth + t - s + 8)
        if j == release:
            pinned = pair[P_PINS, s]
            rest = m - pair[P_HELD + pin, s] - pinned * act[s + 2]
            depth = _push(stack, depth, _EMIT, B, s, 0, 0)
            depth = _push(stack, depth, _EMIT, B, s + 1, 0, 0)
            depth = _push(stack, depth, _EMIT, FA, s, 0, 0)
            if t > s + 1:
                depth = _push(stack, depth, _SOLVE, pinned, s + 2, t, rest)
            elif s + 2 < n:
                depth = _push(stack, depth, _EMIT, D, s + 2, 0, 0)
            depth = _push(stack, depth, _EMIT, FR, s + 1, 0, 0)
            depth = _push(stack, depth, _EMIT, FC, s, 0, 0)
        elif j < 0:
            o = -1 - j
            pinned = opts[o, O_PINS, s]
            depth = _push(stack, depth, _EMIT, B, s, o, 0)
            if t > s:
                rest = m - opts[o, O_GRAPH + pin, s] - pinned * act[s + 1]
                depth = _push(stack, depth, _SOLVE, pinned, s + 1, t, rest)
            elif s + 1 < n:
                depth = _push(stack, depth, _EMIT, D, s + 1, 0, 0)  # only the graph needs it
            depth = _push(stack, depth, _EMIT, FA, s, o, 0)
        else:
            kept = 0 if pin else act[s]  # our a[s], beside the sub-chain j..t
            last = top_after if t == n - 1 else 0
            depth = _push(stack, depth, _SOLVE, pin, s, j - 1, m - last)
            depth = _push(stack, depth, _SOLVE, 0, j, t, m - kept)
            for k in range(j - 1, s, -1):
                depth = _push(stack, depth, _EMIT, FN, k, 0, 0)
            depth = _push(stack, depth, _EMIT, FC, s, 0, 0)
    return out[:count, 0].copy(), out[:count, 1].copy(), out[:count, 2].copy()


@compiled
def _push(stack: np.ndarray, depth: int, tag: int, a: int, b: int, c: int, d: int) -> int:
    stack[depth, 0], stack[depth, 1], stack[depth, 2] = tag, a, b
    stack[depth, 3], stack[depth, 4] = c, d
    return depth + 1


@compiled
def _room(rows: np.ndarray, needed: int) -> np.ndarray:
    """``rows``, or a copy with twice the rows where it has fewer than ``needed``."""
    if needed <= rows.shape[0]:
        return rows
    wider = np.empty((max(needed, 2 * rows.shape[0]), rows.shape[1]), dtype=rows.dtype)
    wider[: rows.shape[0]] = rows
    return wider
