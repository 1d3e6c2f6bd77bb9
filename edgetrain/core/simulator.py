"""The simulator: what a :class:`~edgetrain.core.schedule.Schedule` costs on a chain.

:func:`simulate` replays a schedule on a chain and returns its :class:`Cost`. Memory is counted the
way the executor (:mod:`edgetrain.runtime.checkpointed`) and autograd hold it: an activation's
storage is held while our reference, a graph that saved it as its input, or a graph that saved it
as its output refers to it, and is counted once; a graph holds only what autograd saved; a stage
run forward again works on copies of all its buffers
(:attr:`~edgetrain.core.chain.Stage.recompute_buffer_bytes`; the executor keeps BatchNorm's running
statistics from being updated twice), held during the operation and, after an ``Fa``, those
autograd saved (:attr:`~edgetrain.core.chain.Stage.recompute_saved_buffer_bytes`) by its graph
until its ``B``; a stage whose result depends on buffers its forward changes, run more than once,
holds a snapshot of them (those bytes again) from its first run to its last; what a stage keeps
past its run (:attr:`~edgetrain.core.chain.Stage.retained_bytes`) is held from its first run to the
step's end; each operation adds its measured transient peak; parameter gradients appear as the
backward creates them and stay until the step ends (unless ``grads_exist``: then they were held
before the step and are added to in place). The input ``a[0]``, the weights and the buffers are
held before the step and are not counted. Beside the tensors, each operation's kernels take scratch
while it runs (:attr:`~edgetrain.core.chain.Stage.forward_scratch_bytes`,
:attr:`~edgetrain.core.chain.Stage.backward_scratch_bytes`): ``Cost.peak_bytes`` counts the
tensors, ``Cost.heap_peak_bytes`` the tensors and the scratch, which a budget is checked against.

Recompute factor convention: ``recompute_factor = seconds / (forward_seconds + backward_seconds)``
of the chain, i.e. the time of the schedule over the time of one plain forward and backward. On a
chain of ``l`` equal stages whose forward and backward each cost one unit this is the paper's count:
a schedule with ``ρ`` performs ``2ρl`` forward and backward computations.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Op, Schedule, stores_everything
from edgetrain.errors import InvalidSchedule

_OPS = {op.value: op for op in Op}  # by code: the replay looks kinds up
_FORWARD_CODES = frozenset(op.value for op in Op if op.is_forward)


@dataclass(frozen=True)
class Cost:
    """What a schedule costs on a chain.

    Attributes:
        peak_bytes: most memory the step holds at any moment above what was held before it
            (weights, buffers, input, existing gradients): activations, graphs, activation
            gradients, the parameter gradients it creates, transient peaks included.
        seconds: the schedule's compute time: the sum of its operations' stage times.
        recompute_factor: ``seconds`` over the time of one plain forward and backward.
        forward_steps: forwards without grad (``Fn`` + ``Fc``).
        forward_all_steps: forwards with grad (``Fa`` and ``Fr``).
        max_checkpoints: most activations held as checkpoints at once (the input not counted).
        peak_op: index of the operation at which the peak occurs.
        pages_out / pages_in: paging operations (``Po`` / ``Pi``).
        paged_bytes: bytes written by the page-outs.
        heap_extra_bytes: what the heap holds at its peak beyond ``peak_bytes``: the scratch
            kernels allocate for themselves while a stage runs (``Stage.forward_scratch_bytes``,
            ``Stage.backward_scratch_bytes``), which no tensor holds (see
            :attr:`heap_peak_bytes`).
    """

    peak_bytes: int
    seconds: float
    recompute_factor: float
    forward_steps: int
    forward_all_steps: int
    max_checkpoints: int
    peak_op: int
    pages_out: int = 0
    pages_in: int = 0
    paged_bytes: int = 0
    heap_extra_bytes: int = 0

    @property
    def heap_peak_bytes(self) -> int:
        """The most the step takes from the device's memory: ``peak_bytes`` (tensors) and
        the scratch of the stage running then. A memory budget is checked against this; the
        tensor counter proves ``peak_bytes`` exactly, scratch is measured on the heap."""
        return self.peak_bytes + self.heap_extra_bytes


def simulate(chain: Chain, schedule: Schedule, *, grads_exist: bool = False) -> Cost:
    """Replay ``schedule`` on ``chain``: validate it and return its :class:`Cost`.

    ``grads_exist``: the parameters' gradients exist before the step and are added to in place
    (``zero_grad(set_to_none=False)``); by default they do not (PyTorch's ``zero_grad()``) and the
    backward creates them. Raises :class:`InvalidSchedule` naming the first operation that cannot
    run (a forward whose input is gone, a stage run twice with grad, a backward out of order, ...).

    The store-all plan is plain autograd (the executor runs the stages as they are): when the
    chain carries that step's measured peak (:attr:`Chain.autograd_peak_bytes`), it is the plan's
    ``peak_bytes``; the replay counts every other plan, which the executor runs stage by stage.
    """
    cost = _replay(chain, schedule, None, grads_exist)
    measured = chain.autograd_peak_bytes
    if measured is not None and stores_everything(schedule):
        return replace(cost, peak_bytes=measured[1] if grads_exist else measured[0])
    return cost


def memory_trace(
    chain: Chain, schedule: Schedule, *, grads_exist: bool = False
) -> list[tuple[int, int, int]]:
    """Per operation: bytes held before it, peak bytes during it, bytes held after it."""
    trace: list[tuple[int, int, int]] = []
    _replay(chain, schedule, trace, grads_exist)
    return trace


@dataclass(frozen=True)
class ReplayState:
    """What the replay holds just before one operation runs (see :func:`replay_state`).

    Attributes:
        index: the operation's position in the schedule.
        held_bytes: everything held then (above what the step started with).
        sizes: bytes of each storage ("piece"); pieces[k]: the pieces of activation ``a[k]``.
        refs: references to each piece (our own and the graphs'); plain[k]: ``a[k]`` held by us.
        graph[k]: the graph of stage ``k`` is held; released[k]: built by ``Fr k``.
        graph_pieces[k]: the pieces of its input and output the graph of ``k`` holds.
        copies[k]: buffer copies the graph of ``k`` holds; snapshot_bytes[k]: the buffer
            snapshot of stage ``k``, held now.
        ran[k]: stage ``k`` has run forward; in_backward / next_backward: the backward phase.
        writing_bytes: a page-out of the previous operation still being written.
    """

    index: int
    held_bytes: int
    sizes: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...]
    refs: tuple[int, ...]
    plain: tuple[bool, ...]
    graph: tuple[bool, ...]
    released: tuple[bool, ...]
    graph_pieces: tuple[tuple[int, ...], ...]
    copies: tuple[int, ...]
    snapshot_bytes: tuple[int, ...]
    ran: tuple[bool, ...]
    in_backward: bool
    next_backward: int
    writing_bytes: int


def replay_state(chain: Chain, schedule: Schedule, index: int, *, grads_exist: bool) -> ReplayState:
    """What :func:`simulate`'s replay holds just before operation ``index`` runs."""
    found: list[ReplayState] = []
    _replay(chain, schedule, None, grads_exist, (index, found))
    if not found:
        raise InvalidSchedule(f"operation {index} is not in a schedule of {len(schedule)}")
    return found[0]


def _replay(
    chain: Chain,
    schedule: Schedule,
    trace: list[tuple[int, int, int]] | None,
    grads_exist: bool,
    probe: tuple[int, list[ReplayState]] | None = None,
) -> Cost:
    n = chain.length
    if schedule.length != n:
        raise InvalidSchedule(
            f"schedule is for a chain of {schedule.length} stages, this chain has {n}; re-plan it"
        )
    stages = chain.stages
    grad, sizes, pieces, saved_in, saved_out = _layout(chain)
    refs = [0] * len(sizes)
    plain = [False] * (n + 1)
    graph = [False] * n
    released = [False] * n  # the graph of stage k was built by Fr k: it holds none of a[k]
    ran = [False] * n  # the stage has run forward before: a run again works on buffer copies
    copies = [0] * n  # buffer copies the graph of a stage run again holds
    # A stage whose result depends on buffers its forward changes, run more than once, keeps
    # a snapshot of its buffers from its first run to its last (Stage.reads_updated_buffers).
    kinds, indices = schedule.kinds.tolist(), schedule.indices.tolist()
    last_run: dict[int, int] = {}
    runs = [0] * n
    for i, (code, k) in enumerate(zip(kinds, indices, strict=True)):
        if code in _FORWARD_CODES and 0 <= k < n:
            last_run[k] = i
            runs[k] += 1
    snapshot = [
        stage.recompute_buffer_bytes if stage.reads_updated_buffers and runs[k] > 1 else 0
        for k, stage in enumerate(stages)
    ]
    plain[0] = True
    held = 0
    next_backward = n - 1  # the backward phase goes n-1 .. 0
    in_backward = False
    peak = 0
    heap_peak = 0  # the peak with the scratch of the stage running (Cost.heap_peak_bytes)
    peak_op = -1
    checkpoints = 0
    max_checkpoints = 0
    seconds = 0.0
    forward_steps = 0
    forward_all = 0
    paged = [False] * (n + 1)  # a[k] is in a page file
    writing = 0  # bytes a page-out still holds until the operation after it ends
    pages_out = pages_in = paged_bytes = 0

    def fail(i: int, kind: Op, k: int, why: str) -> InvalidSchedule:
        return InvalidSchedule(f"operation {i} ({kind.code}{k}) {why}")

    def take(ids: list[int]) -> int:
        """Refer to these pieces; returns the bytes that became held."""
        added = 0
        for piece in ids:
            refs[piece] += 1
            added += sizes[piece] if refs[piece] == 1 else 0
        return added

    def drop(ids: list[int]) -> int:
        """Stop referring to these pieces; returns the bytes freed."""
        freed = 0
        for piece in ids:
            refs[piece] -= 1
            freed += sizes[piece] if refs[piece] == 0 else 0
        return freed

    def release(k: int) -> int:
        """Drop our reference to a[k] (the input and the caller's output are never dropped)."""
        nonlocal checkpoints
        if k == 0 or k == n or not plain[k]:
            return 0
        plain[k] = False
        checkpoints -= 1
        return drop(pieces[k])

    forward_scratch = [stage.forward_scratch_bytes for stage in stages]
    backward_scratch = [stage.backward_scratch_bytes for stage in stages]
    # The kinds as locals (an enum member's lookup costs more than the comparison).
    page_out, page_in, discard, backward = Op.PAGE_OUT, Op.PAGE_IN, Op.DISCARD, Op.BACKWARD
    forward_all_op, forward_release = Op.FORWARD_ALL, Op.FORWARD_RELEASE
    forward_nosave = Op.FORWARD_NOSAVE
    for i, (code, k) in enumerate(zip(kinds, indices, strict=True)):
        kind = _OPS.get(code)
        if kind is None:
            kind = Op(code)  # not a kind: Op says so
        forward = code in _FORWARD_CODES
        if probe is not None and probe[0] == i:
            probe[1].append(
                ReplayState(
                    i,
                    held,
                    tuple(sizes),
                    tuple(tuple(p) for p in pieces),
                    tuple(refs),
                    tuple(plain),
                    tuple(graph),
                    tuple(released),
                    tuple(
                        tuple(_kept_by_release(saved_out[j], pieces[j]))
                        if released[j]
                        else tuple(saved_in[j] + saved_out[j])
                        for j in range(n)
                    ),
                    tuple(copies),
                    tuple(snapshot[j] if ran[j] and last_run[j] >= i else 0 for j in range(n)),
                    tuple(ran),
                    in_backward,
                    next_backward,
                    writing,
                )
            )
        before = held
        written, writing = writing, 0
        if kind is page_out:
            if not 0 < k < n or not plain[k]:
                raise fail(i, kind, k, "pages out an activation that is not held")
            if any(refs[piece] != 1 for piece in pieces[k]):
                raise fail(i, kind, k, f"pages out a[{k}], which a graph still holds")
            paged[k] = True
            writing = release(k)  # still held, by the writer, until the next operation ends
            pages_out += 1
            paged_bytes += sum(sizes[piece] for piece in pieces[k])
            during = before
        elif kind is page_in:
            if not paged[k] or plain[k] or any(refs[piece] for piece in pieces[k]):
                raise fail(i, kind, k, f"pages in a[{k}], which is not (only) in a page file")
            paged[k] = False
            plain[k] = True
            checkpoints += 1
            held += take(pieces[k])
            pages_in += 1
            during = held
        elif kind is discard:
            if not 0 < k < n or not plain[k]:
                raise fail(i, kind, k, "discards an activation that is not held")
            held -= release(k)
            during = before
        elif kind is backward:
            if k != next_backward:
                raise fail(
                    i, kind, k, f"is out of order: the next backward must be B{next_backward}"
                )
            if not graph[k]:
                raise fail(i, kind, k, f"needs the graph of stage {k}, which is not in memory")
            if released[k] and not plain[k]:
                raise fail(i, kind, k, f"needs a[{k}] again (Fr{k} released it), which is not held")
            stage = stages[k]
            if not in_backward:
                # The loss: the caller holds the output and hands us its gradient.
                in_backward = True
                held += grad[n]
                before = held
            during = held + stage.backward_peak(grads_exist)
            graph[k] = False
            # The output's gradient is autograd's to free, after the whole backward.
            held -= stage.saved_bytes + (grad[k + 1] if k + 1 < n else 0) + copies[k]
            copies[k] = 0
            if released[k]:
                held -= drop(_kept_by_release(saved_out[k], pieces[k])) + release(k)
                released[k] = False
            else:
                held -= drop(saved_in[k]) + drop(saved_out[k])
            held += grad[k] + stage.made_gradient_bytes(grads_exist)
            next_backward -= 1
            seconds += stage.backward_seconds
        else:
            if not 0 <= k < n:
                raise fail(i, kind, k, f"names a stage outside 0..{n - 1}")
            if not plain[k]:
                raise fail(i, kind, k, f"needs a[{k}], which is not held")
            if in_backward and k > next_backward:
                raise fail(i, kind, k, "recomputes a stage whose backward is already done")
            if plain[k + 1] or graph[k] or _holds(graph, released, saved_in, k + 1):
                # A second copy of a[k+1] (or of its graph): discard the first one before.
                raise fail(i, kind, k, f"recomputes a[{k + 1}], which is already in memory")
            stage = stages[k]
            seconds += stage.forward_seconds
            plain[k + 1] = True
            checkpoints += k + 1 < n
            # Run again, a stage works on copies of its buffers (BatchNorm's running statistics:
            # the recomputation must not update the model's), held while it runs; of all of
            # them, those of a BatchNorm an earlier stage ran too included. Its graph keeps the
            # copies autograd saved (BatchNorm's statistics; not a mask an addition reads).
            again = stage.recompute_buffer_bytes if ran[k] else 0
            kept_copies = stage.recompute_saved_buffer_bytes if ran[k] else 0
            # What the stage keeps past its run is in its forward peaks, and held from its first
            # run on (a run again makes it anew, then drops the last one).
            kept = 0 if ran[k] else stage.retained_bytes
            held += 0 if ran[k] else snapshot[k]  # taken before the first run
            ran[k] = True
            if kind is forward_all_op or kind is forward_release:
                during = held + again + stage.forward_grad_peak_bytes
                graph[k] = True
                copies[k] = kept_copies
                held += take(pieces[k + 1]) + stage.saved_bytes + kept_copies
                if kind is forward_release:
                    # Whatever the graph saved of a[k] is not held (its outputs passed through
                    # from the input are a[k]'s storages too).
                    released[k] = True
                    held += take(_kept_by_release(saved_out[k], pieces[k]))
                else:
                    held += take(saved_out[k]) + take(saved_in[k])
                held -= release(k)
                forward_all += 1
            else:
                during = held + again + stage.forward_peak_bytes
                held += take(pieces[k + 1])
                if kind is forward_nosave:
                    held -= release(k)
                forward_steps += 1
        if forward:
            held += kept
        # The kernels' scratch sits on the transient peak and is freed before the op returns.
        top = during + (
            forward_scratch[k] if forward else backward_scratch[k] if kind is backward else 0
        )
        if held > top:
            top = held
        if top > heap_peak:
            heap_peak = top
        if held > during:
            during = held
        if forward and last_run[k] == i:
            held -= snapshot[k]  # the last run has made its copies of it
        if checkpoints > max_checkpoints:
            max_checkpoints = checkpoints
        if during > peak:
            peak, peak_op = during, i
        held -= written
        if trace is not None:
            trace.append((before, during, held))
    if next_backward != -1:
        raise InvalidSchedule(
            f"schedule ends before the backward of stage {next_backward}; every stage needs a B"
        )
    plain_time = chain.forward_seconds + chain.backward_seconds
    return Cost(
        peak_bytes=peak,
        seconds=seconds,
        recompute_factor=seconds / plain_time if plain_time > 0 else float("nan"),
        forward_steps=forward_steps,
        forward_all_steps=forward_all,
        max_checkpoints=max_checkpoints,
        peak_op=peak_op,
        pages_out=pages_out,
        pages_in=pages_in,
        paged_bytes=paged_bytes,
        heap_extra_bytes=max(0, heap_peak - peak),
    )


_Layout = tuple[list[int], list[int], list[list[int]], list[list[int]], list[list[int]]]


def _layout(chain: Chain) -> _Layout:
    """What a replay of any plan on ``chain`` starts from, which depends on the chain alone
    (kept on it: a planner replays hundreds of plans on one chain): per activation, its
    gradient's bytes; each storage's ("piece's") bytes; each activation's pieces; and the
    pieces each stage's graph saves of its input and of its output. Read, never changed."""
    known: _Layout | None = chain.__dict__.get("_replay_layout_memo")
    if known is not None:
        return known
    n = chain.length
    stages = chain.stages
    grad = [chain.gradient_of_activation_bytes(k) for k in range(n + 1)]
    # An activation is one tensor or several (a cut inside a residual block carries the trunk
    # and the skip); each tensor's storage is a *piece*, and a tensor passed through a stage
    # unchanged is the same piece in its input and its output. Piece 0: the input, which the
    # caller holds (never counted).
    sizes = [0]
    pieces: list[list[int]] = [[0]]
    for stage in stages:
        previous = pieces[-1]
        carried = dict(stage.carried)
        shared = dict(stage.shared_leaves)
        own: list[int] = []
        for leaf in range(stage.output_leaves):
            if leaf in carried:
                j = carried[leaf]
                own.append(previous[j] if j < len(previous) else 0)
            elif shared.get(leaf, leaf) < leaf:
                own.append(own[shared[leaf]])  # a view of an earlier tensor of this output
            else:
                sizes.append(stage.leaf_bytes[leaf] if stage.leaf_bytes else stage.output_bytes)
                own.append(len(sizes) - 1)
        pieces.append(own)
    saved_in = [_held(st.saved_inputs, st.saves_input, pieces[k]) for k, st in enumerate(stages)]
    saved_out = [
        _held(st.saved_outputs, st.saves_output, pieces[k + 1]) for k, st in enumerate(stages)
    ]
    result = (grad, sizes, pieces, saved_in, saved_out)
    object.__setattr__(chain, "_replay_layout_memo", result)
    return result


def _held(which: tuple[int, ...] | None, whole: bool, ids: list[int]) -> list[int]:
    """The pieces of an activation a graph holds: the listed tensors, or all or none."""
    if which is None:
        return list(ids) if whole else []
    return [ids[j] for j in which if j < len(ids)]


def _holds(graph: list[bool], released: list[bool], saved_in: list[list[int]], k: int) -> bool:
    """Whether the graph of stage ``k`` holds part of ``a[k]`` (its input), so that computing
    ``a[k]`` again would make a second copy (a graph built by ``Fr k`` holds none of it)."""
    return k < len(graph) and graph[k] and not released[k] and bool(saved_in[k])


def _kept_by_release(saved_out: list[int], inputs: list[int]) -> list[int]:
    """The pieces of its output a graph built by ``Fr`` holds: those it saved that are not
    pieces of its input (a tensor passed through unchanged is released with the input)."""
    return [piece for piece in saved_out if piece not in inputs]
