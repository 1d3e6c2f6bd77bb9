"""Blocks with several options each: rotor's DP over a chain of blocks (after Rockmate).

A captured model cut at every admissible position is a chain of fine stages; where one tensor
crosses a cut (an articulation cut; besides it, at most small ones such as an attention mask)
a *block* ends. Inside a block the planner may keep some of
its tensors and recompute others; between blocks it plans as rotor does. Each block gets a few
*options* for running it "with grad" in the outer plan (:class:`BlockOption`): store all, recompute
all (keep the block's input, rerun it with grad in the backward), and the plans of the optimal DP
on the block's own stages at every budget, each split where its forward phase ends. Only the
options on the Pareto frontier of (held bytes, peaks, time) are kept; identical blocks (the same
stages and context, as ResNets repeat them) are computed once.

The outer recursion is :class:`~edgetrain.planners.optimal.OptimalTable`'s, on the chain of
blocks: "forward with grad" of a block is the best of its options (:class:`StepCosts` with one
row per option), "checkpoint" runs the block's stages without grad (``Fc`` then ``Fn``). The plan
is expanded into an ordinary :class:`~edgetrain.core.schedule.Schedule` of the fine chain and
checked
with the one simulator. Every number of an option is read off
:func:`~edgetrain.core.simulator.memory_trace` of its operations on the block's stages between
stand-ins for the block's input (counted, or held elsewhere) and for the rest of the chain
(which hands the block its output's gradient), so the prediction is the simulator's.
Pure planning code: no torch.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from edgetrain.core.chain import Chain, Stage
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import memory_trace, simulate
from edgetrain.errors import InvalidInput
from edgetrain.planners.optimal import (
    DEFAULT_SLOTS,
    StepCosts,
    TableMaker,
    chain_costs,
    fastest,
    least_memory,
    resolution,
    store_all,
)

STRATEGY = "blocks"


CARRIED_SHARE = 8
"""A block also ends where, beside one tensor of the stage's own, the tensors crossing the cut
are together at most ``1/CARRIED_SHARE`` of it: the attention mask, labels or rotary tables a
transformer hands every layer. (BERT-base at 128 tokens, batch 8: 4 KiB beside each layer's
3 MiB; cut only where one tensor crosses, its 240 stages are one block, and the least memory
within a recompute factor of 1.15 is that of storing everything; cut here too, 59 blocks and
0.47 of it.) A residual's skip, as large as the trunk beside it, keeps its stages in one block."""


def blocks_of(
    chain: Chain, boundaries: Sequence[int] | None = None, *, small_beside: bool = True
) -> tuple[range, ...]:
    """The chain's stages grouped into blocks, as ranges of stage indices.

    By default a block ends after every stage whose output is one tensor of its own (not a
    tensor it was given, nor a view of one) and, beside it (unless not ``small_beside``), at
    most small tensors (:data:`CARRIED_SHARE`): the articulation cuts of a captured model.
    ``boundaries`` gives the activation indices ``0 < b < L`` where blocks end instead; each must
    be such a cut.
    """
    n = chain.length
    single = [k for k in range(1, n) if is_cut(chain, k, small_beside=small_beside)]
    if boundaries is None:
        cuts = single
    else:
        cuts = sorted(set(boundaries))
        wrong = [b for b in cuts if not 0 < b < n or b not in set(single)]
        if wrong:
            raise InvalidInput(
                f"block boundaries {wrong} are not cuts where one tensor of its own crosses "
                f"(beside tensors under 1/{CARRIED_SHARE} of it); choose among {single}"
            )
    bounds = [0, *cuts, n]
    return tuple(range(a, b) for a, b in itertools.pairwise(bounds))


def is_cut(chain: Chain, k: int, *, small_beside: bool = True) -> bool:
    """Whether a block may end at activation ``k`` (``0 < k < L``): see :func:`blocks_of`."""
    stage = chain.stages[k - 1]
    if stage.shared_leaves:
        return False
    if stage.output_leaves == 1 or not small_beside:
        return stage.output_leaves == 1 and not stage.carried
    sizes = chain.leaf_sizes(k)
    main = max(range(len(sizes)), key=sizes.__getitem__)
    if any(out == main for out, _ in stage.carried):
        return False  # the largest was handed in, not made here
    return (sum(sizes) - sizes[main]) * CARRIED_SHARE <= sizes[main]


@dataclass(frozen=True)
class BlockOption:
    """One way to run a block "with grad" in the outer plan. Bytes and seconds.

    Pairs are ``(input counted, input held elsewhere)``: the block's input held by the plan's
    reference only, or also by the previous block's graph (then it costs nothing here).

    Attributes:
        kind: "store all", "recompute all" or "keep some".
        forward_seconds: its forward phase (every stage once, some without grad).
        held_bytes: what it leaves held after its forward phase besides its output (the input
            among them in the first entry when the option keeps it; never in the second).
        pins_output: whether its last stage's graph holds the block's output (an option that
            runs the last stage without grad in its forward phase builds no graph of it there).
        forward_peak_bytes: most held during the forward phase (the output at its end included).
        backward_seconds: its backward phase, recomputation included.
        backward_peak_bytes: most held during the backward phase, starting from ``held_bytes``,
            the output if the graph holds it (the last block: always) and the output's gradient;
            the parameter gradients it creates included.
        forward_ops, backward_ops: the two phases as operations on the chain's stages.
    """

    kind: str
    forward_seconds: float
    held_bytes: tuple[int, int]
    pins_output: bool
    forward_peak_bytes: tuple[int, int]
    backward_seconds: float
    backward_peak_bytes: tuple[int, int]
    forward_ops: tuple[tuple[Op, int], ...]
    backward_ops: tuple[tuple[Op, int], ...]

    @property
    def seconds(self) -> float:
        """Both phases."""
        return self.forward_seconds + self.backward_seconds

    def metrics(self) -> tuple[float, ...]:
        """What the outer plan pays for it, every entry the less the better."""
        return (*self.held_bytes, *self.forward_peak_bytes, *self.backward_peak_bytes, self.seconds)

    def shifted(self, offset: int) -> BlockOption:
        """The same option for a block whose first stage is ``offset``."""
        return replace(
            self,
            forward_ops=tuple((op, k + offset) for op, k in self.forward_ops),
            backward_ops=tuple((op, k + offset) for op, k in self.backward_ops),
        )


def block_options(
    chain: Chain, block: range, *, grads_exist: bool = False, slots: int = DEFAULT_SLOTS
) -> tuple[BlockOption, ...]:
    """The Pareto-optimal options of running ``block`` of ``chain`` with grad (see the module
    docstring), operations in the chain's stage indices, fastest first."""
    if not 0 <= block.start < block.stop <= chain.length or block.step != 1:
        raise InvalidInput(f"block {block} is not a range of stages of this chain")
    stages = tuple(s.renamed("") for s in chain.stages[block.start : block.stop])
    last = block.stop == chain.length
    out_grad = None if last else chain.gradient_of_activation_bytes(block.stop)
    local = _options(
        stages,
        chain.activation_bytes(block.start),
        chain.requires_grad(block.start),
        out_grad,
        grads_exist,
        slots,
    )
    return tuple(option.shifted(block.start) for option in local)


@functools.lru_cache(maxsize=512)
def _options(
    stages: tuple[Stage, ...],
    input_bytes: int,
    input_requires_grad: bool,
    out_grad: int | None,
    grads_exist: bool,
    slots: int,
) -> tuple[BlockOption, ...]:
    """Options of one block in one context (cached: repeated blocks are computed once)."""
    sub = Chain(stages, input_bytes=input_bytes, input_requires_grad=input_requires_grad)
    measured = [
        _measure(sub, kind, forward, backward, out_grad, grads_exist)
        for kind, forward, backward in _candidates(sub, grads_exist, slots, out_grad is not None)
    ]
    options = [option for option in measured if option is not None]
    kept: list[BlockOption] = []
    for option in sorted(options, key=lambda o: (o.seconds, o.metrics())):
        if not any(_dominates(other, option) for other in options) and all(
            o.metrics() != option.metrics() for o in kept
        ):
            kept.append(option)
    return tuple(kept)


def _dominates(a: BlockOption, b: BlockOption) -> bool:
    return all(x <= y for x, y in zip(a.metrics(), b.metrics(), strict=True)) and (
        a.metrics() != b.metrics()
    )


Ops = tuple[tuple[Op, int], ...]


def _candidates(
    sub: Chain, grads_exist: bool, slots: int, followed: bool
) -> list[tuple[str, Ops, Ops]]:
    """Plans of the block's own stages, each split where its forward phase ends; ``followed``:
    the block is not the chain's last (whose output the caller holds)."""
    n = sub.length
    plans = [_phases(store_all(sub))]
    if n > 1:
        walk = [(Op.FORWARD_CHECKPOINT, 0)] + [(Op.FORWARD_NOSAVE, k) for k in range(1, n - 1)]
        # The block again with grad, as rotor runs it: only the graph needs a[n-1].
        again = [(Op.FORWARD_ALL, k) for k in range(n - 1)] + [(Op.DISCARD, n - 1)]
        again += [(Op.BACKWARD, k) for k in reversed(range(n - 1))]
        ops = [*walk, (Op.FORWARD_ALL, n - 1), (Op.BACKWARD, n - 1), *again]
        plans.append(_phases(Schedule.from_ops(n, ops)))
        # A budget on the block's own peak does not ask for plans that hold little after the
        # forward phase; in the outer plan the rest of the chain runs on top of what they hold.
        # So the block is also planned followed by a stand-in for that rest, whose forward and
        # backward peak ``rest`` bytes: the larger ``rest``, the more the plans save on what
        # the forward phase leaves held. The DP counts a tensor carried across a cut (the skip)
        # at every cut, so its budgets run to twice the simulated store-all peak; to the
        # nearest slot as well as up.
        peak = simulate(sub, store_all(sub), grads_exist=grads_exist).heap_peak_bytes
        for rest in (0, peak // 2, peak, 2 * peak) if followed else (0,):
            plans += _dp_plans(sub, rest, grads_exist, slots)
    out: list[tuple[str, Ops, Ops]] = []
    seen: set[tuple[Ops, Ops]] = set()
    for plan in plans:
        if plan in seen:
            continue
        seen.add(plan)
        forward, backward = plan
        grads = sum(op.builds_graph for op, _ in forward)
        kind = "store all" if grads == n else "recompute all" if grads == 1 else "keep some"
        out.append((kind, forward, backward))
    return out


def _dp_plans(sub: Chain, rest: int, grads_exist: bool, slots: int) -> list[tuple[Ops, Ops]]:
    """The optimal DP's plans of the block at every budget, the block followed by a stand-in
    whose forward and backward peak ``rest`` bytes (none if 0), as forward and backward
    phases: the operations before the stand-in runs and after its backward."""
    n = sub.length
    chain = sub
    if rest:
        tail = replace(
            _stand_in(0, True, sub.gradient_of_activation_bytes(n) if n else None),
            forward_peak_bytes=rest,
            forward_grad_peak_bytes=rest,
            backward_peak_bytes=rest,
        )
        chain = Chain((*sub.stages, tail), sub.input_bytes, sub.input_requires_grad)
    peak = simulate(chain, store_all(chain), grads_exist=grads_exist).heap_peak_bytes
    slot_bytes, count = resolution(chain, max(2 * peak, 1), slots)
    plans: list[tuple[Ops, Ops]] = []
    # Each rounding's costs once, for the comparison and the table.
    rounded = {near: chain_costs(chain, slot_bytes, grads_exist, near) for near in (False, True)}
    rounding = TableMaker(chain, grads_exist, costs=lambda _, near: rounded[near])
    for nearest in (False, True) if rounding.rounding_matters(slot_bytes) else (False,):
        table = rounding.table(slot_bytes, count, nearest=nearest)
        times = table.times()
        previous = math.inf
        for m in np.flatnonzero(np.isfinite(times)):
            if times[m] < previous:  # the plan changes only where the time does
                schedule = table.schedule(int(m))
                if rest:
                    every = tuple(schedule)
                    start = every.index((Op.FORWARD_ALL, n))
                    stop = every.index((Op.BACKWARD, n))
                    plans.append((every[:start], every[stop + 1 :]))
                else:
                    plans.append(_phases(schedule))
                previous = float(times[m])
    return plans


def _phases(schedule: Schedule) -> tuple[Ops, Ops]:
    """A plan's operations split where its forward phase ends."""
    every = tuple(schedule)
    end = schedule.forward_phase_end
    return every[:end], every[end:]


def _stand_in(output_bytes: int, requires_grad: bool, input_gradient: int | None) -> Stage:
    """A stage that costs nothing: the block's input, or the rest of the chain after it."""
    return Stage(
        name="",
        output_bytes=output_bytes,
        saved_bytes=0,
        saves_input=False,
        forward_peak_bytes=0,
        forward_grad_peak_bytes=0,
        backward_peak_bytes=0,
        weight_bytes=0,
        gradient_bytes=0,
        forward_seconds=0.0,
        backward_seconds=0.0,
        output_requires_grad=requires_grad,
        input_gradient_bytes=input_gradient,
    )


def _in_context(
    sub: Chain, counted: bool, out_grad: int | None
) -> tuple[Chain, int, list[tuple[Op, int]], list[tuple[Op, int]]]:
    """The block between stand-ins: an input stage when the input is counted, an output stage
    unless the block ends the chain. Returns the chain, the offset of the block's first stage,
    and the operations that run the stand-ins before and after the block's forward phase."""
    stages = list(sub.stages)
    offset = 0
    before: list[tuple[Op, int]] = []
    if counted:
        stages.insert(0, _stand_in(sub.input_bytes, sub.input_requires_grad, None))
        offset = 1
        before = [(Op.FORWARD_ALL, 0)]
    after: list[tuple[Op, int]] = []
    if out_grad is not None:
        stages.append(_stand_in(0, True, out_grad))
        after = [(Op.FORWARD_ALL, len(stages) - 1), (Op.BACKWARD, len(stages) - 1)]
    chain = Chain(
        tuple(stages),
        input_bytes=0 if counted else sub.input_bytes,
        input_requires_grad=False if counted else sub.input_requires_grad,
    )
    return chain, offset, before, after


def _measure(
    sub: Chain, kind: str, forward: Ops, backward: Ops, out_grad: int | None, grads_exist: bool
) -> BlockOption | None:
    """An option's numbers, read off the simulator's trace in both contexts; None if its
    backward phase leaves more held than storing everything leaves (the input's gradient, the
    parameter gradients and, in the chain's last block, its output and that output's gradient;
    an output that is a view of an input held elsewhere is not counted again)."""
    held: list[int] = []
    fwd_peak: list[int] = []
    bwd_peak: list[int] = []
    output = sub.stages[-1].output_bytes
    for counted in (True, False):
        trace, split, end, forward_end = _trace_in_context(
            sub, counted, out_grad, forward, backward, grads_exist
        )
        fwd_peak.append(max(during for _, during, _ in trace[:forward_end]))
        # Below zero where the output carries a tensor of the input held elsewhere: nothing.
        held.append(max(0, trace[forward_end - 1][2] - output))
        bwd_peak.append(max(trace[split][0], *(during for _, during, _ in trace[split:end])))
        if trace[end - 1][2] != _left_by_storing_all(sub, counted, out_grad, grads_exist):
            return None
    stages = sub.stages
    return BlockOption(
        kind=kind,
        forward_seconds=_seconds(stages, forward),
        held_bytes=(held[0], held[1]),
        pins_output=(Op.FORWARD_ALL, len(stages) - 1) in forward and stages[-1].saves_whole_output,
        forward_peak_bytes=(fwd_peak[0], fwd_peak[1]),
        backward_seconds=_seconds(stages, backward),
        backward_peak_bytes=(bwd_peak[0], bwd_peak[1]),
        forward_ops=forward,
        backward_ops=backward,
    )


def _trace_in_context(
    sub: Chain,
    counted: bool,
    out_grad: int | None,
    forward: Ops,
    backward: Ops,
    grads_exist: bool,
) -> tuple[list[tuple[int, int, int]], int, int, int]:
    """The simulator's trace of the block's ``forward`` then ``backward`` phases between its
    stand-ins (see :func:`_in_context`), and where its backward phase starts and ends and its
    forward phase ends in it."""
    chain, offset, before, after = _in_context(sub, counted, out_grad)
    ops = [*before, *((op, k + offset) for op, k in forward), *after]
    split = len(ops)
    ops += [(op, k + offset) for op, k in backward]
    end = len(ops)
    ops += [(Op.BACKWARD, 0)] if counted else []
    trace = memory_trace(chain, Schedule.from_ops(chain.length, ops), grads_exist=grads_exist)
    return trace, split, end, len(before) + len(forward)


@functools.lru_cache(maxsize=512)
def _left_by_storing_all(sub: Chain, counted: bool, out_grad: int | None, grads_exist: bool) -> int:
    """What the block's backward phase leaves held when it stores everything: what every
    valid option must leave."""
    forward, backward = _phases(store_all(sub))
    trace, _, end, _ = _trace_in_context(sub, counted, out_grad, forward, backward, grads_exist)
    return trace[end - 1][2]


def _seconds(stages: Sequence[Stage], ops: Ops) -> float:
    """The compute time of these operations, as the simulator adds it up."""
    total = 0.0
    for op, k in ops:
        if op is Op.BACKWARD:
            total += stages[k].backward_seconds
        elif op.is_forward:
            total += stages[k].forward_seconds
    return total


@functools.lru_cache(maxsize=512)
def _no_grad_peaks(
    stages: tuple[Stage, ...], input_bytes: int, input_requires_grad: bool
) -> tuple[int, int]:
    """Peaks of running a block without grad: keeping its input (``Fc``, the input not
    counted) and from its input (``Fn``, the input counted). Read off the simulator's trace."""
    sub = Chain(stages, input_bytes=input_bytes, input_requires_grad=input_requires_grad)
    peaks = []
    for counted in (False, True):
        chain, offset, _, _ = _in_context(sub, counted, 0)
        # Fc 0 keeps the block's input (or the stand-in's, which gives the block its input).
        ops = [(Op.FORWARD_CHECKPOINT, 0)]
        ops += [(Op.FORWARD_NOSAVE, k) for k in range(1, sub.length + offset)]
        walked = len(ops)
        # The rest makes a plan the simulator accepts: drop the block's output, then run
        # everything with grad and back.
        ops += [(Op.DISCARD, chain.length - 1)]
        ops += [(Op.FORWARD_ALL, k) for k in range(chain.length)]
        ops += [(Op.BACKWARD, k) for k in reversed(range(chain.length))]
        trace = memory_trace(chain, Schedule.from_ops(chain.length, ops))
        peaks.append(max(during for _, during, _ in trace[:walked]))
    return peaks[0], peaks[1]


@dataclass(frozen=True)
class BlockPlan:
    """The chain of blocks of one chain, with every block's options.

    Attributes:
        chain: the fine chain.
        blocks: its blocks (ranges of stage indices).
        options: per block, its options (operations in the chain's indices).
        grads_exist: as in :func:`~edgetrain.core.simulator.simulate`.
    """

    chain: Chain
    blocks: tuple[range, ...]
    options: tuple[tuple[BlockOption, ...], ...]
    grads_exist: bool = False

    def costs(self) -> StepCosts:
        """The recursion's costs of the chain of blocks, in bytes."""
        chain = self.chain
        blocks = self.blocks
        n = len(blocks)
        bounds = [b.start for b in blocks] + [chain.length]
        width = max(len(o) for o in self.options)
        created = [s.made_gradient_bytes(self.grads_exist) for s in chain.stages]
        after = np.concatenate([np.cumsum(created[::-1])[::-1], [0]])
        no_grad = [
            _no_grad_peaks(
                tuple(s.renamed("") for s in chain.stages[b.start : b.stop]),
                chain.activation_bytes(b.start),
                chain.requires_grad(b.start),
            )
            for b in blocks
        ]
        fwd_peak = np.zeros((width, 2, n), dtype=np.int64)
        graph = np.zeros((width, 2, n), dtype=np.int64)
        bwd_peak = np.zeros((width, 2, n), dtype=np.int64)
        pins = np.zeros((width, n), dtype=bool)
        seconds = np.full((width, n), np.inf)
        for s, options in enumerate(self.options):
            for o, option in enumerate(options):
                fwd_peak[o, :, s] = option.forward_peak_bytes
                graph[o, :, s] = option.held_bytes
                bwd_peak[o, :, s] = option.backward_peak_bytes
                pins[o, s] = option.pins_output
                seconds[o, s] = option.seconds
        return StepCosts(
            act=np.array([0] + [chain.activation_bytes(b) for b in bounds[1:]], dtype=np.int64),
            grad=np.array([chain.gradient_of_activation_bytes(b) for b in bounds], dtype=np.int64),
            held_grads=after[bounds].astype(np.int64),
            first=np.array([p[0] for p in no_grad], dtype=np.int64),
            step=np.array([p[1] for p in no_grad], dtype=np.int64),
            fwd_time=np.array(
                [sum(chain.stages[k].forward_seconds for k in b) for b in blocks],
                dtype=np.float64,
            ),
            opt_fwd_peak=fwd_peak,
            opt_graph=graph,
            opt_pins=pins,
            opt_bwd_peak=bwd_peak,
            opt_time=seconds,
        )

    def expand(self, ops: list[tuple[Op, int, int]]) -> list[tuple[Op, int]]:
        """The recursion's operations on blocks as operations on the chain's stages."""
        out: list[tuple[Op, int]] = []
        for op, s, o in ops:
            if op is Op.DISCARD:
                out.append((op, self.blocks[s].start))
            elif op is Op.FORWARD_ALL:
                out.extend(self.options[s][o].forward_ops)
            elif op is Op.BACKWARD:
                out.extend(self.options[s][o].backward_ops)
            else:
                block = self.blocks[s]
                out.append((op, block.start))
                out.extend((Op.FORWARD_NOSAVE, k) for k in block[1:])
        return out

    def maker(self) -> TableMaker:
        """Tables of this chain of blocks at any resolution."""
        in_bytes = self.costs()
        unit = 0
        for values in (
            in_bytes.act,
            in_bytes.grad,
            in_bytes.held_grads,
            in_bytes.first,
            in_bytes.step,
            in_bytes.opt_fwd_peak,
            in_bytes.opt_graph,
            in_bytes.opt_bwd_peak,
        ):
            unit = math.gcd(unit, int(np.gcd.reduce(np.asarray(values).ravel())))

        def costs(slot_bytes: float, nearest: bool) -> StepCosts:
            return in_bytes.in_slots(slot_bytes, nearest)

        return TableMaker(
            self.chain,
            self.grads_exist,
            length=len(self.blocks),
            unit=unit,
            costs=costs,
            expand=self.expand,
            strategy=STRATEGY,
            checked=any(
                not is_cut(self.chain, b.stop, small_beside=False) for b in self.blocks[:-1]
            ),
        )


def cut_sets(chain: Chain) -> tuple[tuple[int, ...], ...]:
    """The block boundaries the planners try: the cuts one tensor alone crosses and, where they
    differ, those with small tensors beside it too. Neither set's plans contain the other's:
    finer blocks give the outer plan more places to keep and drop, coarser ones plan more of
    the chain inside one block at the block's finer memory resolution (on random chains each
    found least peaks and plans the other missed)."""
    alone = tuple(b.stop for b in blocks_of(chain, small_beside=False)[:-1])
    beside = tuple(b.stop for b in blocks_of(chain)[:-1])
    return (alone,) if beside == alone else (alone, beside)


def block_plan(
    chain: Chain,
    boundaries: Sequence[int] | None = None,
    *,
    grads_exist: bool = False,
    slots: int = DEFAULT_SLOTS,
) -> BlockPlan:
    """The chain's blocks (:func:`blocks_of`) and every block's options (:func:`block_options`)."""
    blocks = blocks_of(chain, boundaries)
    options = tuple(block_options(chain, b, grads_exist=grads_exist, slots=slots) for b in blocks)
    return BlockPlan(chain, blocks, options, grads_exist)


def plan_blocks(
    chain: Chain,
    memory_bytes: float,
    *,
    boundaries: Sequence[int] | None = None,
    slots: int = DEFAULT_SLOTS,
    grads_exist: bool = False,
) -> Schedule:
    """The fastest block plan within ``memory_bytes``, as a schedule of the fine chain.

    Raises :class:`~edgetrain.errors.InfeasibleBudget` with the smallest budget that works.
    """
    maker = block_plan(chain, boundaries, grads_exist=grads_exist, slots=slots).maker()
    return fastest(maker, memory_bytes, slots)


def minimum_block_memory(
    chain: Chain,
    *,
    boundaries: Sequence[int] | None = None,
    slots: int = DEFAULT_SLOTS,
    grads_exist: bool = False,
) -> float:
    """The smallest budget (bytes) with which :func:`plan_blocks` finds a plan."""
    maker = block_plan(chain, boundaries, grads_exist=grads_exist, slots=slots).maker()
    return least_memory(maker, slots)
