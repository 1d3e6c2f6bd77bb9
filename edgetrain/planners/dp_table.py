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
out, checking each with the simulator. The table is filled one span at a time, vectorised with
numpy over every sub-chain of that span, every split point and every memory size.

The work is about ``L**3 / 3 * slots`` operations, so long chains get fewer slots (never fewer than
:data:`MIN_SLOTS`): the plan is then optimal at a coarser memory resolution, and still fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided, sliding_window_view

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Op, Schedule
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.planners.dp_kernels import least_sum, shift_each
from edgetrain.planners.step_costs import StepCosts, chain_costs

DEFAULT_SLOTS = 500
MIN_SLOTS = 48
WORK_LIMIT = 1.2e8
"""Table cells times split points the planner fills at most (about a second of numpy)."""
TABLE_LIMIT_BYTES = 2**30
"""Largest table (time and choice arrays) the planner builds."""


def max_slots(length: int) -> int:
    """The most memory slots a table for a chain of ``length`` stages may have."""
    by_work = int(WORK_LIMIT / max(1.0, length**3 / 3))
    by_size = TABLE_LIMIT_BYTES // (2 * length * length * 12) - 1
    return max(1, min(max(MIN_SLOTS, by_work), by_size))


_SOLVE, _EMIT, _SOLVED = 0, 1, 2
"""The kinds of items on :meth:`OptimalTable.operations`' stack."""

NO_PLAN = np.iinfo(np.int32).min
"""The choice of a cell no plan fits in."""


Expand = Callable[[list[tuple[Op, int, int]]], list[tuple[Op, int]]]
"""Turns the recursion's operations ``(op, stage, option)`` into the chain's ``(op, index)``."""


def _drop_options(ops: list[tuple[Op, int, int]]) -> list[tuple[Op, int]]:
    return [(op, k) for op, k, _ in ops]


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
        self._expand = expand or _drop_options
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
        # No sub-problem is ever shifted by more than this many slots (see _fill).
        widest = max(
            int(z.act.max()),
            int(z.act[n] + z.grad[n]),
            int((z.opt_graph + z.act[None, None, 1:]).max()),
            0 if z.pair_held is None or n < 2 else int((z.pair_held[:, :-1] + z.act[2:]).max()),
        )
        self._pad = min(size, max(widest, 0))
        # time[pin, d, s, m] (a view of a table with ``_pad`` slots of inf before m = 0): the
        # sub-chain s..s+d, so that a span's sub-problems are contiguous. reach[d, s, m]: the
        # same for pin 0 plus the forward time before the sub-chain (prefix[s]), so that a
        # checkpoint's candidates need one addition; left[d, s, m] = time[0, d, s, m + a[s]].
        self._padded = np.full((2, n, n, self._pad + size), np.inf)
        self._time = self._padded[..., self._pad :]
        self._windows = sliding_window_view(self._padded, size, axis=-1)
        # Contiguous rows (no padding between them), so that numpy adds a span at a time.
        self._reach = np.full((n, n, size), np.inf)
        self._left = np.full((n, n, size), np.inf)
        self._pinned = np.full((n, n, size), np.inf)  # time[1]
        # The first finite slot of each time[pin, d, s] (the rows are non-increasing in m).
        self._first = np.full((2, n, n), size, dtype=np.int64)
        self._prefix = np.concatenate([[0.0], np.cumsum(z.fwd_time)])
        self._least = _least_times(z)
        # The options that exist, stage by stage (option 0 always, so no stage has none): the
        # fill reads a span's graph-first starts off a prefix of these pairs.
        exists = np.isfinite(z.opt_time)
        exists[0] = True
        self._opt_s, self._opt_o = np.nonzero(exists.T)
        self._opt_count = np.concatenate([[0], np.cumsum(exists.sum(axis=0))])
        self._choices: dict[tuple[int, int, int], list[int]] = {}
        self._solved: dict[tuple[int, int, int, int], list[tuple[Op, int, int]]] = {}
        self._fill()

    # -- the recursion -----------------------------------------------------------------------------

    def _fill(self) -> None:
        """Every sub-chain's least times, one span at a time. Only the times are kept: the
        choice behind a cell is worked out again, from the same numbers, when a plan is read
        (:meth:`_choice_row`), so the fill takes a minimum, not an argmin."""
        n = self.length
        size = self.slots + 1
        act = self._z.act
        for span in range(n):
            s = np.arange(n - span)
            for pin in (0, 1):
                best, _ = self._span(span, pin, s, choose=False)
                self._time[pin, span, s] = best
                finite = np.isfinite(best)
                first = np.where(finite.any(axis=1), finite.argmax(axis=1), size)
                self._first[pin, span, s] = first
                if pin == 1:
                    self._pinned[span, s] = best
                else:
                    self._reach[span, s] = best + self._prefix[s][:, None]
                    index = np.arange(size)[None, :] + act[s][:, None]
                    left = np.take_along_axis(best, np.minimum(index, size - 1), axis=-1)
                    self._left[span, s] = np.where(index < size, left, np.inf)

    def _span(
        self, span: int, pin: int, s: np.ndarray, choose: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Least times (and, with ``choose``, the choices: -1 - o = graph first with option o,
        j = checkpoint at j) of the sub-chains ``s..s+span`` for every memory size. Without
        ``choose``, ``s`` is every start of the span (the fill)."""
        z = self._z
        n = self.length
        options = z.opt_time.shape[0]
        t = s + span
        top = t == n - 1
        grad_in = np.where(top, 0, z.grad[np.minimum(t + 1, n)])
        # The caller's output, once the forward is done; its gradient, once the loss is.
        after = np.where(top, z.act[n] + z.grad[n], 0)
        entry_rest = grad_in + z.held_grads[t + 1]
        left_b = z.grad[s] + z.held_grads[s] + after
        own = np.zeros_like(s) if pin else z.act[s]
        if choose:
            # The options of each row that exist (option 0 first, always): the first of equal
            # options, as over every option (those that do not exist take inf).
            o_all = self._opt_o[self._opt_s == s[0]][:, None] if len(s) == 1 else None
            if o_all is None:
                o_all = np.arange(options)[:, None]
            values = self._graph_first(span, pin, o_all, s[None, :], entry_rest, after, left_b)
            best = values.min(axis=0)
            choice: np.ndarray | None = (-1 - o_all[values.argmin(axis=0), 0]).astype(np.int32)
        else:
            # The options that exist, rows in order: each row's least over its own pairs.
            count = self._opt_count[len(s)]
            row_of = self._opt_s[:count]
            values = self._graph_first(
                span,
                pin,
                self._opt_o[:count],
                row_of,
                entry_rest[row_of],
                after[row_of],
                left_b[row_of],
            )
            best = np.minimum.reduceat(values, self._opt_count[: len(s)], axis=0)
            choice = None
        if span > 0 and z.pair_time is not None:
            value = self._release(s, pin, span, entry_rest, after, left_b)
            better = value < best
            best = np.where(better, value, best)
            if choice is not None:
                choice = np.where(better, np.int32(-1 - options), choice)
        if span > 0:
            # Checkpoint at j: forward to a[j], the sub-chain j..t owning a[j], then s..j-1
            # again from a[s].
            stop = self._saturated(best, span, s)
            value, pick = self._checkpoints(span, pin, s, own, after, entry_rest, choose, stop)
            value -= self._prefix[s][:, None]
            # Ties (to rounding) go to graph first, the plan with fewer operations.
            better = value < best * (1 - 1e-12)
            best = np.where(better, value, best)
            if choice is not None and pick is not None:
                choice = np.where(better, (s[:, None] + 1 + pick).astype(np.int32), choice)
        return best, choice

    def _graph_first(
        self,
        span: int,
        pin: int,
        o: np.ndarray,
        s: np.ndarray,
        entry_rest: np.ndarray,
        after: np.ndarray,
        left_b: np.ndarray,
    ) -> np.ndarray:
        """Times of starting the sub-chains ``s..s+span`` graph first with option ``o`` (arrays
        that broadcast; the per-row numbers already taken at ``s``), inf where it does not fit:
        its forward phase, the sub-chain ``s+1..t``, its backward phase; each phase's peak, and
        what it leaves (the larger counts)."""
        z = self._z
        m = np.arange(self.slots + 1)
        peak_f = entry_rest + z.opt_fwd_peak[o, pin, s]
        peak_b = z.held_grads[s + 1] + z.opt_bwd_peak[o, pin, s]
        if span > 0:
            peak_b = peak_b + after  # the caller's output and its gradient, if top
        peak_b = np.maximum(peak_b, left_b)
        ok = m >= np.maximum(peak_f, peak_b)[..., None]
        base = z.opt_time[o, s][..., None]
        if span == 0:
            return np.where(ok, base, np.inf)
        pinned = z.opt_pins[o, s].astype(np.int64)
        shift = z.opt_graph[o, pin, s] + pinned * z.act[s + 1]
        inner = self._windows[pinned, span - 1, s + 1, self._back(shift)]
        return np.where(ok, base + inner, np.inf)

    def _checkpoints(
        self,
        span: int,
        pin: int,
        s: np.ndarray,
        own: np.ndarray,
        after: np.ndarray,
        entry_rest: np.ndarray,
        choose: bool,
        stop: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The least time (plus the forward time before ``s``) of starting each sub-chain
        ``s..s+span`` with a checkpoint, over every split ``j``; with ``choose``, the best split
        (``j - s - 1``, the first of equals). From slot ``stop[row]`` on no checkpoint can win
        (:meth:`_saturated`): the fill leaves those slots inf."""
        z = self._z
        n = self.length
        m = np.arange(self.slots + 1)
        q = np.arange(1, span + 1)  # split j = s + q
        walk = np.maximum.accumulate(
            np.concatenate(
                [z.first[s][:, None], z.step[np.minimum(s[:, None] + q[None, :-1], n - 1)]],
                axis=1,
            ),
            axis=1,
        )  # walk[:, q-1]: peak of reaching a[s+q] from a[s]
        reached = entry_rest[:, None] + walk  # peak walking to a[j], besides our a[s]
        if choose:
            return self._checkpoints_of(span, pin, s, own, after, reached, True)
        # Every start but the last (top) one: the candidates are views of the tables, with
        # pin 0 counted in slots above a[s] (left) and its result shifted back.
        rows = len(s) - 1
        value = np.empty((len(s), len(m)))
        if rows > 0:
            stride = self._reach.strides
            shape = (span, rows, len(m))
            far = as_strided(self._reach[span - 1, 1:], shape, (stride[1] - stride[0], *stride[1:]))
            near = self._left[:span, :rows] if pin == 0 else self._pinned[:span, :rows]
            # Below the first slot where some candidate is finite, every one is inf.
            q = np.arange(1, span + 1)[:, None]
            row = np.arange(rows)[None, :]
            near_first = self._first[pin, q - 1, row]
            if pin == 0:
                near_first = near_first - own[:rows][None, :]
            limit = reached[:rows].T
            # Below a candidate's first finite slot its sum is inf already: only where the walk
            # to a[j] needs more (rarely) does the fit rule out slots of its own.
            finite_from = np.maximum(self._first[0, span - q, row + q], near_first)
            binding = limit > finite_from
            start = int(np.maximum(limit, finite_from).min())
            low = np.full((rows, len(m)), np.inf)
            # Above every row's saturation (in the coordinates of low) nothing is computed.
            end = int((stop[:rows] - (own[:rows] if pin == 0 else 0)).max(initial=0))
            end = min(len(m), max(end, 0))
            if start < end:
                start = max(start, 0)
                low[:, start:end] = least_sum(far, near, limit, binding, start, end)
            value[:rows] = low if pin else shift_each(low, own[:rows])
        top, _ = self._checkpoints_of(
            span, pin, s[rows:], own[rows:], after[rows:], reached[rows:], False
        )
        value[rows:] = top
        return value, None

    def _saturated(self, best: np.ndarray, span: int, s: np.ndarray) -> np.ndarray:
        """Per row, the first slot from which ``best`` (graph first or release) is the least
        time any plan of the sub-chain can take (every stage once, its fastest option: a
        checkpoint's time is at least that, so it cannot win the tie-break there); the row's
        size where it never is."""
        size = best.shape[1]
        if self._least is None:
            return np.full(len(s), size)
        floor = self._least[span, s] * (1 + 1e-13)
        done = best <= floor[:, None]
        first: np.ndarray = np.where(done.any(axis=1), done.argmax(axis=1), size)
        return first

    def _checkpoints_of(
        self,
        span: int,
        pin: int,
        s: np.ndarray,
        own: np.ndarray,
        after: np.ndarray,
        reached: np.ndarray,
        choose: bool,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`_checkpoints` for any starts ``s``, gathering the shifted rows."""
        m = np.arange(self.slots + 1)
        q = np.arange(1, span + 1)
        if len(s) == 1:
            return self._checkpoints_at(span, pin, int(s[0]), int(own[0]), after, reached, choose)
        j = s[:, None] + q[None, :]
        cand = shift_each(self._reach[span - q[None, :], j], own[:, None])
        cand += self._windows[pin, q[None, :] - 1, s[:, None], self._back(after)[:, None]]
        np.copyto(cand, np.inf, where=m[None, None, :] < (own[:, None] + reached)[:, :, None])
        if not choose:
            return cand.min(axis=1), None
        pick = np.argmin(cand, axis=1)
        return np.take_along_axis(cand, pick[:, None, :], axis=1)[:, 0, :], pick

    def _checkpoints_at(
        self,
        span: int,
        pin: int,
        s: int,
        own: int,
        after: np.ndarray,
        reached: np.ndarray,
        choose: bool,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`_checkpoints_of` for one start ``s`` (its rows sliced, not gathered)."""
        size = self.slots + 1
        q = np.arange(1, span + 1)
        cand = np.full((span, size), np.inf)
        if own < size:
            inner = self._windows[pin, :span, s, int(self._back(after)[0])]
            np.add(self._reach[span - q, s + q, : size - own], inner[:, own:], out=cand[:, own:])
        np.copyto(cand, np.inf, where=np.arange(size)[None, :] < own + reached[0][:, None])
        if not choose:
            return cand.min(axis=0)[None, :], None
        pick = np.argmin(cand, axis=0)
        return cand[pick, np.arange(size)][None, :], pick[None, :]

    def _choice_row(self, pin: int, s: int, t: int) -> list[int]:
        """The choices behind the cells of sub-chain ``s..t`` (as :meth:`_span` makes them;
        the row is kept)."""
        _, found = self._span(t - s, pin, np.array([s]), choose=True)
        assert found is not None
        row: list[int] = found[0].tolist()
        self._choices[(pin, s, t)] = row
        return row

    def _back(self, offset: np.ndarray) -> np.ndarray:
        """Where a row shifted right by ``offset`` slots starts in a window of the padded
        table (offsets beyond the padding read only inf)."""
        index: np.ndarray = self._pad - np.minimum(offset, self._pad)
        return index

    def _release(
        self,
        s: np.ndarray,
        pin: int,
        span: int,
        entry_rest: np.ndarray,
        after: np.ndarray,
        left_b: np.ndarray,
    ) -> np.ndarray:
        """Times of the *release* start at every ``s`` of this span (inf where it does not fit
        or does not exist): ``Fc s``, ``Fr s+1``, the sub-chain ``s+2..t``, ``Fa s``, ``B s+1``,
        ``B s``."""
        z = self._z
        assert z.pair_time is not None and z.pair_fwd_peak is not None
        assert z.pair_bwd_peak is not None and z.pair_held is not None
        assert z.pair_pins is not None
        m = np.arange(self.slots + 1)
        peak_f = entry_rest + z.pair_fwd_peak[pin, s]
        peak_b = z.held_grads[np.minimum(s + 2, self.length)] + z.pair_bwd_peak[pin, s]
        if span > 1:
            peak_b = peak_b + after
        peak_b = np.maximum(peak_b, left_b)
        ok = m[None, :] >= np.maximum(peak_f, peak_b)[:, None]
        base = z.pair_time[s]
        if span == 1:
            return np.where(ok, base[:, None], np.inf)
        pinned = z.pair_pins[s].astype(np.int64)
        shift = z.pair_held[pin, s] + pinned * z.act[s + 2]
        inner = self._windows[pinned, span - 2, s + 2, self._back(shift)]
        return np.where(ok, base[:, None] + inner, np.inf)

    # -- queries -----------------------------------------------------------------------------------

    def time(self, slots: int) -> float:
        """Least time (seconds) of a step within ``slots`` slots (inf if none fits)."""
        return float(self._time[1, self.length - 1, 0, min(slots, self.slots)])

    def times(self) -> np.ndarray:
        """Least step time for every budget 0..slots (inf where none fits)."""
        row: np.ndarray = self._time[1, self.length - 1, 0].copy()
        return row

    def smallest_feasible_slots(self) -> int | None:
        """Fewest slots any plan needs, or None if even ``slots`` is too few."""
        finite = np.flatnonzero(np.isfinite(self.times()))
        return int(finite[0]) if finite.size else None

    def operations(self, slots: int) -> list[tuple[Op, int, int]]:
        """The optimal plan within ``slots`` slots as the recursion's operations ``(op, stage,
        option)`` (the option of an ``Fa`` and its ``B``; 0 otherwise)."""
        n = self.length
        slots = min(slots, self.slots)
        if not np.isfinite(self._time[1, n - 1, 0, slots]):
            raise InfeasibleBudget(f"no plan fits in {slots} slots", None)
        z = self._z
        act, opt_graph, opt_pins = z.act.tolist(), z.opt_graph.tolist(), z.opt_pins.tolist()
        top_after = act[n] + int(z.grad[n])
        release = -1 - z.opt_time.shape[0]
        ops: list[tuple[Op, int, int]] = []
        # Explicit stack: (SOLVE, pin, s, t, m), (EMIT, operation) or (SOLVED, cell, first):
        # the cell's operations are ops[first:] (kept: the plans of neighbouring budgets share
        # most of their cells).
        stack: list[tuple[Any, ...]] = [(_SOLVE, 1, 0, n - 1, slots)]
        solved = self._solved
        choices = self._choices
        while stack:
            item = stack.pop()
            tag = item[0]
            if tag == _EMIT:
                ops.append(item[1])
                continue
            if tag == _SOLVED:
                solved[item[1]] = ops[item[2] :]
                continue
            _, pin, s, t, m = item
            cell = (pin, s, t, m)
            known = solved.get(cell)
            if known is not None:
                ops.extend(known)
                continue
            row = choices.get((pin, s, t))
            j = (self._choice_row(pin, s, t) if row is None else row)[m]
            stack.append((_SOLVED, cell, len(ops)))
            if j == release:
                self._push_release(stack, pin, s, t, m)
            elif j < 0:
                o = -1 - j
                pinned = opt_pins[o][s]
                stack.append((_EMIT, (Op.BACKWARD, s, o)))
                if t > s:
                    inner = m - opt_graph[o][pin][s] - pinned * act[s + 1]
                    stack.append((_SOLVE, int(pinned), s + 1, t, inner))
                elif s + 1 < n:
                    stack.append((_EMIT, (Op.DISCARD, s + 1, 0)))  # only the graph needs a[s+1]
                stack.append((_EMIT, (Op.FORWARD_ALL, s, o)))
            else:
                own = 0 if pin else act[s]
                after = top_after if t == n - 1 else 0
                stack.append((_SOLVE, pin, s, j - 1, m - after))
                stack.append((_SOLVE, 0, j, t, m - own))
                stack.extend((_EMIT, (Op.FORWARD_NOSAVE, k, 0)) for k in range(j - 1, s, -1))
                stack.append((_EMIT, (Op.FORWARD_CHECKPOINT, s, 0)))
        return ops

    def _push_release(self, stack: list[tuple[Any, ...]], pin: int, s: int, t: int, m: int) -> None:
        """Push the *release* start of cell ``(pin, s, t, m)``'s operations, last first."""
        z = self._z
        assert z.pair_held is not None and z.pair_pins is not None
        pinned = int(z.pair_pins[s])
        held = int(z.pair_held[pin, s]) + pinned * int(z.act[s + 2])
        stack.append((_EMIT, (Op.BACKWARD, s, 0)))
        stack.append((_EMIT, (Op.BACKWARD, s + 1, 0)))
        stack.append((_EMIT, (Op.FORWARD_ALL, s, 0)))
        if t > s + 1:
            stack.append((_SOLVE, pinned, s + 2, t, m - held))
        elif s + 2 < self.length:
            stack.append((_EMIT, (Op.DISCARD, s + 2, 0)))
        stack.append((_EMIT, (Op.FORWARD_RELEASE, s + 1, 0)))
        stack.append((_EMIT, (Op.FORWARD_CHECKPOINT, s, 0)))

    def schedule(self, slots: int, params: dict[str, object] | None = None) -> Schedule:
        """The optimal plan within ``slots`` slots, as a schedule of the chain."""
        slots = min(slots, self.slots)
        ops = self._expand(self.operations(slots))
        info: dict[str, object] = {"budget_bytes": int(slots * self.slot_bytes), "slots": slots}
        info.update(params or {})
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
