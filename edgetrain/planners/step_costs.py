"""What the optimal DP reads about each of its stages: :class:`StepCosts`, and
:func:`chain_costs` for a chain's own stages (rotor's costs, one option each, and the *release*
start). Blocks of stages with several options each make theirs in
:mod:`edgetrain.planners.blocks`. Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgetrain.core.chain import Chain


@dataclass(frozen=True)
class StepCosts:
    """What the recursion reads about each of its ``n`` stages, in slots (or bytes) and seconds.

    A *stage* of the recursion is a stage of the chain (:func:`chain_costs`) or a block of
    consecutive stages (:mod:`edgetrain.planners.blocks`). Running it with grad ("graph first")
    is one of ``O`` *options*; an option that does not exist has an infinite time. Peaks are
    above what is held outside the sub-problem; ``[o, pin, s]`` arrays have the
    pinned/unpinned axis of the table (pin 0: ``a[s]`` is held by our reference only and
    counted; pin 1: it is also held outside, and free).

    Attributes:
        act: ``a[k]``, k = 0..n (``a[0]`` = 0: held by the caller).
        grad: the gradient of ``a[k]``, k = 0..n.
        held_grads: parameter gradients held once stages k..n-1 are done, k = 0..n.
        first: peak of running stage s without grad keeping ``a[s]`` (``Fc``), ``a[s]`` not
            counted, ``a[s+1]`` held at the end.
        step: peak of running stage s without grad from ``a[s]`` (``Fn``), ``a[s]`` counted.
        fwd_time: seconds of a forward without grad.
        opt_fwd_peak: peak of option o's forward phase (``a[s]`` counted when pin 0).
        opt_graph: what option o leaves held after its forward phase besides ``a[s+1]``.
        opt_pins: whether option o's graph holds all of ``a[s+1]``.
        opt_bwd_peak: peak of option o's backward phase, starting from ``opt_graph``, ``a[s+1]``
            if its graph holds it and the gradient of ``a[s+1]``; the parameter gradients of
            later stages not counted, the ones it creates counted.
        opt_time: seconds of option o's forward and backward phases (inf: no such option).
        pair_fwd_peak, pair_held, pair_pins, pair_bwd_peak, pair_time: the same for the
            *release* start at stage s (``Fc s``, ``Fr s+1`` .. ``Fa s``, ``B s+1``, ``B s``;
            ``[pin, s]`` arrays; what it leaves held besides ``a[s+2]``, ``a[s]`` when counted
            included; the backward peak after the sub-chain ``s+2..t``; inf time where stage
            s+1 saves nothing of its input). None: no such start (blocks).
    """

    act: np.ndarray
    grad: np.ndarray
    held_grads: np.ndarray
    first: np.ndarray
    step: np.ndarray
    fwd_time: np.ndarray
    opt_fwd_peak: np.ndarray
    opt_graph: np.ndarray
    opt_pins: np.ndarray
    opt_bwd_peak: np.ndarray
    opt_time: np.ndarray
    pair_fwd_peak: np.ndarray | None = None
    pair_held: np.ndarray | None = None
    pair_pins: np.ndarray | None = None
    pair_bwd_peak: np.ndarray | None = None
    pair_time: np.ndarray | None = None

    @property
    def length(self) -> int:
        """Number of stages of the recursion."""
        return int(self.fwd_time.shape[0])

    def in_slots(self, slot_bytes: float, nearest: bool = False) -> StepCosts:
        """The same costs in slots of ``slot_bytes``: rounded up (a plan that fits in the table
        fits in reality) or, with ``nearest``, to the nearest slot."""

        def up(values: np.ndarray) -> np.ndarray:
            scaled = np.asarray(values, dtype=np.float64) / slot_bytes
            rounded = np.floor(scaled + 0.5) if nearest else np.ceil(scaled)
            return rounded.astype(np.int64)

        return StepCosts(
            act=up(self.act),
            grad=up(self.grad),
            held_grads=up(self.held_grads),
            first=up(self.first),
            step=up(self.step),
            fwd_time=self.fwd_time,
            opt_fwd_peak=up(self.opt_fwd_peak),
            opt_graph=up(self.opt_graph),
            opt_pins=self.opt_pins,
            opt_bwd_peak=up(self.opt_bwd_peak),
            opt_time=self.opt_time,
            pair_fwd_peak=None if self.pair_fwd_peak is None else up(self.pair_fwd_peak),
            pair_held=None if self.pair_held is None else up(self.pair_held),
            pair_pins=self.pair_pins,
            pair_bwd_peak=None if self.pair_bwd_peak is None else up(self.pair_bwd_peak),
            pair_time=self.pair_time,
        )


def chain_costs(chain: Chain, slot_bytes: float, grads_exist: bool, nearest: bool) -> StepCosts:
    """Rotor's costs for the stages of ``chain``, one option each (forward with grad, then
    backward), in slots: every size rounded up (or to the nearest) on its own, then added."""

    def up(values: list[int]) -> np.ndarray:
        if nearest:
            return np.array([math.floor(v / slot_bytes + 0.5) for v in values], dtype=np.int64)
        return np.array([math.ceil(v / slot_bytes) for v in values], dtype=np.int64)

    stages = chain.stages
    n = chain.length
    created = up([s.made_gradient_bytes(grads_exist) for s in stages])
    held = np.concatenate([np.cumsum(created[::-1])[::-1], [0]]).astype(np.int64)
    act = up([0] + [s.output_bytes for s in stages])
    grad = up([chain.gradient_of_activation_bytes(k) for k in range(n + 1)])
    extra = up([s.saved_bytes for s in stages])
    saved_in = up([chain.saved_input_bytes(k) for k in range(n)])
    saved_out = up([chain.saved_output_bytes(k) for k in range(n)])
    transients = [s.heap_transients(grads_exist) for s in stages]  # kernel scratch included
    fwd_peak, fwd_grad_peak, bwd_peak = (up(list(peaks)) for peaks in zip(*transients, strict=True))
    fwd_time = np.array([s.forward_seconds for s in stages], dtype=np.float64)
    bwd_time = np.array([s.backward_seconds for s in stages], dtype=np.float64)
    s = np.arange(n)
    graph = np.stack([extra + saved_in, extra])  # [pin, s]
    own = np.stack([act[s], np.zeros_like(s)])
    # The forward with grad: its transient peak on top of a[s]; then its graph and a[s+1].
    fwd = np.maximum(own + fwd_grad_peak, graph + act[s + 1])
    # The backward: graph, a[s+1] if the graph holds it (or the caller does: the last
    # stage), the gradient of a[s+1], and its transient peak.
    out = np.where(s + 1 == n, act[s + 1], saved_out)
    bwd = graph + out + grad[s + 1] + bwd_peak
    # Release: Fc p, Fr q (q = p + 1), the sub-chain q+1.., then Fa p, B q, B p. Arrays over
    # p = 0..n-1 (p = n-1 has no q: its time is inf); q's values at min(p + 1, n - 1).
    q = np.minimum(s + 1, n - 1)
    after_q = np.minimum(s + 2, n)
    keep_p = np.stack([act[s], np.zeros_like(s)])  # our checkpoint a[p]: counted, or held outside
    first = np.maximum(fwd_peak, act[s + 1])
    pair_fwd = keep_p + np.maximum(
        np.maximum(first, act[q] + fwd_grad_peak[q]), extra[q] + act[after_q]
    )
    pair_pins = np.array([st.saves_whole_output and not st.carried for st in stages], dtype=bool)
    pair_pins = pair_pins[q]
    pair_held = keep_p + extra[q]
    out_q = np.where(after_q == n, act[after_q], saved_out[q])
    rest = keep_p + extra[q] + out_q + grad[after_q]  # when the sub-chain q+1.. is done
    with_p = rest - keep_p + graph + act[q]  # after Fa p: its graph and a[q] again
    # B p: q's graph is gone; the caller's output and its gradient stay when q is the last.
    caller = np.where(after_q == n, act[n] + grad[n], 0)
    pair_bwd = np.maximum(
        np.maximum(rest + fwd_grad_peak, with_p + bwd_peak[q]),
        graph + saved_out + grad[q] + created[q] + bwd_peak + caller,
    )
    pair_time = 2 * fwd_time + fwd_time[q] + bwd_time + bwd_time[q]
    pair_time = np.where((s + 1 < n) & (saved_in[q] > 0), pair_time, np.inf)
    return StepCosts(
        act=act,
        grad=grad,
        held_grads=held,
        first=first,
        step=np.maximum(act[s] + fwd_peak, act[s + 1]),
        fwd_time=fwd_time,
        opt_fwd_peak=fwd[None],
        opt_graph=graph[None],
        opt_pins=np.array([st.saves_whole_output for st in stages], dtype=bool)[None],
        opt_bwd_peak=bwd[None],
        opt_time=(fwd_time + bwd_time)[None],
        pair_fwd_peak=pair_fwd,
        pair_held=pair_held,
        pair_pins=pair_pins,
        pair_bwd_peak=pair_bwd,
        pair_time=pair_time,
    )
