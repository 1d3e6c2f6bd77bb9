"""Reference planner for tests: Dijkstra over every schedule of a small chain.

It knows nothing of the dynamic program: it walks all states (which activations we hold, which
graphs, how far the backward has come) reachable by any operation, keeping each operation's peak
within the budget, and returns the fastest schedule. Its memory count is written from the
simulator's documented rules, independently of :func:`edgetrain.core.simulator.simulate`: an
activation
is held while our reference, a graph that saved it as input, or a graph that saved it as output
refers to it; the caller holds the output, autograd its gradient; parameter gradients stay
from their backward on.
Exponential in the chain length: for L <= 6.
"""

from __future__ import annotations

import heapq
import itertools

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Op, Schedule


def fastest_schedule(
    chain: Chain,
    budget: int,
    *,
    nested: bool = True,
    release: bool = False,
    grads_exist: bool = False,
    persistent: bool = True,
) -> tuple[float, Schedule | None]:
    """The least time of any valid schedule whose peak stays within ``budget`` bytes.

    By default the class of rotor's recursion (``OptimalTable(..., release=False)``), which is
    ``nested`` and ``persistent``:

    ``nested``: no stage runs forward while the graph of a later stage is held. Without it,
    every schedule; that can be faster in rare cases (recomputing an earlier stage with grad
    before a later backward, about 4 in 10 000 random chain/budget pairs).
    ``persistent``: an activation held across a backward (a checkpoint) stays held until its own
    stage's ``Fa`` takes it: no ``Fn``, ``Fr`` or ``D`` frees it first. Without it, a
    checkpoint may serve to rebuild later activations and be dropped before its own stage's
    backward, to be made again by the ``Fa`` of the stage before it, which runs anyway (on
    4-stage chains, e.g. ``Fc0 Fc1 Fn2 Fa3 B3 Fn1 Fa2 B2 Fa0 Fa1 B1 B0``): faster at a few
    budgets near the least (about 1 in 125 random pairs of a 1-5-stage chain and a budget, most
    of them drawn among the three least).
    ``grads_exist``: the loop that keeps parameter gradients (a backward holds only those it
    must sum with an earlier stage's, and peaks as its stage says for that loop). ``release``:
    ``Fr`` too (a graph that holds nothing of its input, which must be held again for its
    backward, which drops it); nested then also lets a stage run forward while the released
    graph of the next stage is held (rebuilding its input).
    """
    n = chain.length
    st = chain.stages
    act = [0] + [s.output_bytes for s in st]
    grad = [chain.gradient_of_activation_bytes(k) for k in range(n + 1)]

    def memory(plain: int, graph: int, rel: int, nb: int, loss: bool) -> int:
        total = 0
        for k in range(n + 1):
            held = (plain >> k) & 1
            held |= k < n and st[k].saves_input and (graph >> k) & 1 and not (rel >> k) & 1
            held |= k >= 1 and st[k - 1].saves_output and (graph >> (k - 1)) & 1
            if held:
                total += act[k]
        total += sum(st[k].saved_bytes for k in range(n) if (graph >> k) & 1)
        if loss:
            total += grad[nb + 1] + (grad[n] if nb + 1 < n else 0)
            total += sum(st[k].made_gradient_bytes(grads_exist) for k in range(nb + 1, n))
        return total

    State = tuple[int, int, int, int, bool, int]
    # (plain, graph, released, next backward, loss taken, kept: plain held across a backward)
    start: State = (1, 0, 0, n - 1, False, 0)  # plain bit 0: the input
    counter = itertools.count()
    queue: list[tuple[float, int, State, tuple[tuple[Op, int], ...]]] = [
        (0.0, next(counter), start, ())
    ]
    best: dict[State, float] = {start: 0.0}
    while queue:
        time, _, state, ops = heapq.heappop(queue)
        if best.get(state, float("inf")) < time:
            continue
        plain, graph, rel, nb, loss, kept = state
        if nb == -1:
            return time, Schedule.from_ops(n, list(ops), "exhaustive")
        held = memory(plain, graph, rel, nb, loss)
        moves: list[tuple[float, int, State, tuple[Op, int]]] = []
        fixed = kept if persistent else 0  # only their own Fa takes them
        for k in range(n):
            if not (plain >> k) & 1 or (loss and k > nb):
                continue
            later = graph >> (k + 1)
            if nested and later and not (later == 1 and (rel >> (k + 1)) & 1):
                continue
            out_held = (plain >> (k + 1)) & 1 or (graph >> k) & 1
            out_held |= (
                k + 1 < n
                and st[k + 1].saves_input
                and (graph >> (k + 1)) & 1
                and not (rel >> (k + 1)) & 1
            )
            if out_held:
                continue  # a second copy of a[k+1]
            with_out = plain | (1 << (k + 1))
            consumed = with_out & ~(1 << k) if k > 0 else with_out
            taken = kept & ~(1 << k)
            moves.append(
                (
                    st[k].forward_seconds,
                    held + st[k].forward_grad_peak_bytes,
                    (consumed, graph | (1 << k), rel, nb, loss, taken),
                    (Op.FORWARD_ALL, k),
                )
            )
            if release and not (fixed >> k) & 1:
                moves.append(
                    (
                        st[k].forward_seconds,
                        held + st[k].forward_grad_peak_bytes,
                        (consumed, graph | (1 << k), rel | (1 << k), nb, loss, taken),
                        (Op.FORWARD_RELEASE, k),
                    )
                )
            moves.append(
                (
                    st[k].forward_seconds,
                    held + st[k].forward_peak_bytes,
                    (with_out, graph, rel, nb, loss, kept),
                    (Op.FORWARD_CHECKPOINT, k),
                )
            )
            if k > 0 and not (fixed >> k) & 1:
                moves.append(
                    (
                        st[k].forward_seconds,
                        held + st[k].forward_peak_bytes,
                        (consumed, graph, rel, nb, loss, taken),
                        (Op.FORWARD_NOSAVE, k),
                    )
                )
        for k in range(1, n):
            if (plain >> k) & 1 and not (fixed >> k) & 1:
                moves.append(
                    (0.0, held, (plain & ~(1 << k), graph, rel, nb, loss, kept), (Op.DISCARD, k))
                )
        released = (rel >> nb) & 1
        if (graph >> nb) & 1 and (not released or (plain >> nb) & 1):
            before = memory(plain, graph, rel, nb, True)
            left = plain & ~(1 << nb) if released and nb > 0 else plain
            new = (
                left,
                graph & ~(1 << nb),
                rel & ~(1 << nb),
                nb - 1,
                True,
                left if persistent else 0,
            )
            moves.append(
                (
                    st[nb].backward_seconds,
                    before + st[nb].backward_peak(grads_exist),
                    new,
                    (Op.BACKWARD, nb),
                )
            )
        for cost, peak, new, op in moves:
            after = memory(*new[:5])
            if max(peak, after) > budget:
                continue
            if time + cost < best.get(new, float("inf")) - 1e-12:
                best[new] = time + cost
                heapq.heappush(queue, (time + cost, next(counter), new, (*ops, op)))
    return float("inf"), None
