"""Measuring one stage on this device, as the executor runs it (:mod:`edgetrain.autograd.stages`):
the bytes autograd keeps (tensor storages, each counted once) and the transient peaks of its
forward and backward, its time (:class:`Timer`: the least process CPU time of several runs) or, on
meta tensors, its floating-point operations.
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from edgetrain.autograd.buffer_state import BufferFlow
from edgetrain.autograd.stage_state import StageParams, buffer_copy_bytes, stage_params
from edgetrain.autograd.stages import (
    differentiable,
    leaves,
    run_backward,
    run_forward,
    run_forward_with_grad,
)
from edgetrain.autograd.storage_counter import StorageCounter, storage_bytes, storage_key
from edgetrain.errors import InvalidInput
from edgetrain.frontend.caller_gradient import caller_gradients, wanted_by_caller
from edgetrain.frontend.device_speed import DeviceSpeed, OpSeconds

LAYER_TYPES: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.Linear,
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.ReLU,
    nn.LeakyReLU,
    nn.ReLU6,
    nn.SiLU,
    nn.GELU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
)
"""Layers whose outputs the paper's memory model counts as activations (no pooling, no reshapes)."""


class Timer:
    """How :func:`profile_chain` times a stage: ``repeats`` runs of its forward and its backward,
    each
    timed by :attr:`clock`, summarised by :meth:`summary`.

    The clock is the process's CPU time (``time.process_time``), not the wall clock: on a
    machine shared with other jobs the wall clock of a stage stretches with their load (two
    profiles of one model differed 2-3× in total), and a plan made on such times changes from
    run to run. Process CPU time counts the work of every thread of this process, so it includes
    torch's intra-op (OpenMP) workers; the calling thread's time (``time.thread_time``) would
    miss them (with two torch threads it saw half of a convolution's CPU time). With one torch
    thread the two agree. CPU time does not count waiting (none in a CPU stage) and counts
    what the intra-op workers spin, so with several threads it overstates a stage by that much.
    """

    def __init__(self, repeats: int) -> None:
        if repeats < 1:
            raise InvalidInput(f"repeats must be at least 1, got {repeats}")
        self.repeats = repeats

    clock = staticmethod(time.process_time)

    @staticmethod
    def summary(samples: list[float]) -> float:
        """Seconds of one run of a stage from the repeats' samples: the minimum.

        Interference only adds time (a cache another job flushed, a page fault), so the least
        of the repeats is the stage's own cost. Two profiles each of ViT-Tiny (batch 8, 128²) and
        MobileNetV2 (8, 128²), 3 repeats, with other jobs on both cores: per-stage times
        differed by a median 4-6 % with the minimum against 6-7 % with the median (90th
        percentile 13-18 % against 20-24 %), and a plan made on one profile ran at most 0.9 %
        slower on the other's times than that profile's own plan (median: 1.3 %; the wall
        clock: 5.6 %).
        """
        return min(samples)


@dataclass(frozen=True)
class Measured:
    """One stage's measured costs, before parameters shared between stages are sorted out
    (fields as in :class:`~edgetrain.core.chain.Stage`; ``param_grad_ids``: the parameters that got
    a
    gradient)."""

    output_bytes: int
    saved_bytes: int
    saves_input: bool
    saves_output: bool
    forward_peak_bytes: int
    forward_grad_peak_bytes: int
    backward_peak_bytes: int
    backward_peak_kept_bytes: int
    forward_seconds: float
    backward_seconds: float
    layer_output_bytes: int
    output_requires_grad: bool
    param_grad_ids: set[int]
    leaf_bytes: tuple[int, ...] = ()
    carried: tuple[tuple[int, int], ...] = ()
    shared_leaves: tuple[tuple[int, int], ...] = ()
    saved_inputs: tuple[int, ...] | None = None
    saved_outputs: tuple[int, ...] | None = None
    input_gradient_bytes: int | None = None
    gradient_from: tuple[int, ...] = ()
    outputs_needing_grad: tuple[int, ...] | None = None
    gradient_outputs: int = 0  # output tensors a gradient flows to
    gradient_layouts: tuple[bool, ...] = (False,)  # see _layouts
    # (backward_peak_bytes, backward_peak_kept_bytes) with every output gradient held until
    # the backward ends: measured (by profile_stages) only where two of them share one storage.
    backward_peaks_held: tuple[int, int] | None = None
    reads_updated_buffers: bool = False
    saved_buffer_bytes: int | None = None
    retained_bytes: int = 0
    forward_scratch_bytes: int = 0
    backward_scratch_bytes: int = 0
    caller_gradients: tuple[int, ...] | None = None  # the last stage's: see Stage


def measure_held(
    measured: list[tuple[str, nn.Module, int, Measured]],
    pending: dict[int, tuple[Any, bool | list[bool], tuple[Any, ...] | None]],
    memo: dict[tuple[Any, ...], tuple[int, int]],
    index_of: dict[int, int],
    *,
    complete: bool,
) -> None:
    """Settle the ``pending`` stages (index -> input, whether it needs a gradient, memo key)
    that the stages profiled so far decide (:func:`_gradients_shared`): one whose step gives
    two of its output gradients one storage gets its held peaks (measured, or from ``memo``
    for a twin); the others are dropped, with their input."""
    for k, shared in enumerate(_gradients_shared(measured, complete=complete)):
        if k not in pending or shared is None:
            continue  # not waiting, or still open: a later stage decides
        x, needs_grad, key = pending.pop(k)
        if not shared:
            continue
        name, module, span, result = measured[k]
        held = memo.get(key) if key is not None else None
        if held is None:
            params = stage_params(module, index_of)
            held = _held_backward_peaks(module, x, needs_grad, params, k, result)
            if key is not None:
                memo[key] = held
        measured[k] = (name, module, span, replace(result, backward_peaks_held=held))


def _gradients_shared(
    measured: list[tuple[str, nn.Module, int, Measured]], *, complete: bool = True
) -> list[bool | None]:
    """Per stage, whether two of its output tensors get one gradient storage in the step: the
    next stage's backward passes an output gradient of its own on to both (an addition of the
    trunk and this stage's branch), or to tensors that later get one so. The storage then lives
    until the stage's backward ends (see :attr:`Measured.backward_peaks_held`).

    ``complete``: ``measured`` is the whole model, whose output gradients (the caller's) are
    distinct. Else it is the stages profiled so far, and a stage two of whose output gradients
    may still be given one storage by stages not yet profiled is None (open)."""
    shared: list[bool | None] = [False] * len(measured)
    # The storage of each gradient of a[k + 1] (stage k's output), by tensor: one made by a
    # stage not profiled yet is an open one (only while the chain is incomplete).
    after: dict[int, object] = {}
    open_ones: set[int] = set()
    if not complete and measured:
        after = {j: object() for j in range(max(1, len(measured[-1][3].leaf_bytes)))}
        open_ones = {id(storage) for storage in after.values()}
    for k in reversed(range(len(measured))):
        storages = [id(storage) for storage in after.values()]
        if len(storages) != len(set(storages)):
            shared[k] = True
        elif len(open_ones.intersection(storages)) > 1:
            shared[k] = None
        # a[k]'s gradients: one passed on is the storage of the output gradient it came from.
        after = {
            i: after.setdefault(j, object())
            for i, j in enumerate(measured[k][3].gradient_from)
            if j >= 0
        }
    return shared


def profile_stage(
    name: str,
    module: nn.Module,
    x: Any,
    needs_grad: bool | list[bool],
    timer: Timer | None,
    flops_per_second: float,
    index: int,
    params: StageParams,
    last: bool = False,
    speed: DeviceSpeed | None = None,
    calls: TorchDispatchMode | None = None,
) -> tuple[Measured, Any]:
    """One stage's measures and its output; ``calls`` (an
    :class:`~edgetrain.autograd.scratch.OpScratch`) sees the operator calls of the passes that
    size it (not those that time it)."""
    counter = StorageCounter()
    layer_outputs = _LayerOutputs(module)
    with counter, calls or nullcontext():
        base = counter.reset_peak()
        with layer_outputs:
            out = run_forward(module, x, stage=index, name=name)
        forward_peak = counter.peak_bytes - base
        output_bytes = storage_bytes(leaves(out))
        # What the forward made that its output does not hold: a tensor the module keeps
        # (torch.nn.utils.spectral_norm's hook sets the weight it computes as an attribute).
        retained_bytes = max(
            0, counter.live_bytes - base + _passed_through_bytes(x, out) - output_bytes
        )

        saved: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.add(storage_key(t))
            return t

        param_grads: dict[int, torch.Tensor] = {}

        def held_sink(i: int, grad: torch.Tensor) -> None:
            param_grads[i] = grad if i not in param_grads else param_grads[i] + grad

        base = counter.reset_peak()
        flow = BufferFlow(module) if any(True for _ in module.buffers()) else nullcontext()
        # Timed by the device model in the passes that size the stage (none run twice).
        forward_time = OpSeconds(speed) if speed is not None else nullcontext()
        backward_time = OpSeconds(speed) if speed is not None else nullcontext()
        with flow, forward_time, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, graph = run_forward_with_grad(
                module,
                x,
                needs_input_grad=needs_grad,
                params=params,
                sink=held_sink,
                stage=index,
                name=name,
            )
        forward_grad_peak = counter.peak_bytes - base
        in_keys = [storage_key(t) for t in leaves(x)]
        out_keys = [storage_key(t) for t in leaves(y)]
        reads_updated = isinstance(flow, BufferFlow) and flow.reaches(saved | set(out_keys))
        saved_buffer_bytes = buffer_copy_bytes(module, saved)
        # Output tensors passed through unchanged: the same storage as an input tensor.
        carried = tuple((i, in_keys.index(key)) for i, key in enumerate(out_keys) if key in in_keys)
        # Output tensors sharing one storage (views of one result): one piece of memory.
        shared = tuple(
            (i, out_keys.index(key))
            for i, key in enumerate(out_keys)
            if out_keys.index(key) < i and i not in dict(carried)
        )
        new_out = [t for i, t in enumerate(leaves(y)) if i not in dict(carried)]
        new_saved_bytes = storage_bytes([t for t in new_out if storage_key(t) in saved])
        leaf_bytes = tuple(int(t.untyped_storage().nbytes()) for t in leaves(y))
        output_requires_grad = any(t.requires_grad for t in leaves(y))
        needing = _outputs_needing_grad(leaves(y))
        del y, new_out
        kept = counter.live_bytes - base
        saved_out_leaves = tuple(i for i, key in enumerate(out_keys) if key in saved)
        saved_in_leaves = tuple(j for j, key in enumerate(in_keys) if key in saved)
        saves_output = bool(saved_out_leaves)

        out_leaves = leaves(out)
        # The model's last stage gets a gradient only where the caller's backward starts.
        wanted = wanted_by_caller(graph.outputs, out) if last else list(graph.outputs)
        loss_leaves = caller_gradients(out) if last else None
        grad_out = _output_gradients(wanted, out_leaves, random=True)
        # The model's last stage gets the caller's gradient, which the caller holds to the end.
        held = list(grad_out) if last else []
        out_grad_keys = [None if g is None else storage_key(g) for g in grad_out]
        # A freed storage's key may come back for a new one: only a live one is passed on.
        freed: set[int] = set()
        for j, g in enumerate(grad_out):
            if g is not None:
                weakref.finalize(g.untyped_storage(), freed.add, j)
        del g  # the loop's name would hold the last output gradient through the backward
        base = counter.reset_peak()
        with backward_time:
            input_grads = run_backward(graph, grad_out)
        backward_peak = counter.peak_bytes - base
        # A gradient passed on (a skip's, or a view of the output's, as cat's backward makes)
        # is the output gradient's storage; an addition hands one gradient to both inputs.
        gradient_from = tuple(
            _passed_from(g, out_grad_keys, freed) if g is not None else -1 for g in input_grads
        )
        made = [
            g for g, j in zip(input_grads, gradient_from, strict=True) if g is not None and j < 0
        ]
        input_gradient_bytes = (
            storage_bytes(made) if any(g is not None for g in input_grads) else None
        )
        if all(j < 0 for j in gradient_from):
            gradient_from = ()
        del graph, input_grads, grad_out, held, made
        grad_ids = {id(p) for i, p in params.params if i in param_grads}
        param_grads.clear()
        again = partial(_backward_peak, module, x, needs_grad, params, index, last=last)
        # An output laid out other than contiguously (attention's output is a transpose) gets
        # a gradient of its own layout in the first pass; in the step it gets what the next
        # stage's backward returns, often contiguous, and its backward may then copy it
        # (nn.MultiheadAttention's does: 8 KB more in a step of its test). Both count.
        layouts = _layouts(wanted, out_leaves)
        if len(layouts) > 1:
            backward_peak = max(backward_peak, again(kept=False, contiguous=True))
        # Again, as in a loop that keeps gradients: each is added in place as it is computed.
        backward_peak_kept = max(again(kept=True, contiguous=c) for c in layouts)
        gradient_outputs = sum(wanted)
        del out_leaves
    saves_input = bool(saved_in_leaves)
    several_in, several_out = len(in_keys) > 1, len(out_keys) > 1

    forward_seconds = backward_seconds = 0.0
    if timer is not None:
        forward_seconds, backward_seconds = _time_stage(
            module, x, needs_grad, timer, index, name, params
        )
    elif isinstance(forward_time, OpSeconds) and isinstance(backward_time, OpSeconds):
        forward_seconds, backward_seconds = forward_time.seconds, backward_time.seconds
    elif flops_per_second > 0:
        forward_flops, backward_flops = _count_flops(module, x, needs_grad, index, name, params)
        elements = sum(t.numel() for t in leaves(out))
        forward_seconds = (forward_flops + elements) / flops_per_second
        backward_seconds = (backward_flops + 2 * elements) / flops_per_second
    if not output_requires_grad:
        # Nothing trainable before it and no gradient into it (a frozen backbone's stages):
        # the step runs no backward for it (what autograd calls there only returns).
        backward_seconds = 0.0
    result = Measured(
        output_bytes=output_bytes,
        saved_bytes=kept - new_saved_bytes,
        saves_input=saves_input,
        saves_output=saves_output,
        leaf_bytes=leaf_bytes if several_out or carried else (),
        carried=carried,
        shared_leaves=shared,
        saved_inputs=saved_in_leaves if several_in else None,
        saved_outputs=saved_out_leaves if several_out or carried else None,
        input_gradient_bytes=input_gradient_bytes,
        gradient_from=gradient_from,
        forward_peak_bytes=forward_peak,
        forward_grad_peak_bytes=forward_grad_peak,
        backward_peak_bytes=backward_peak,
        backward_peak_kept_bytes=backward_peak_kept,
        gradient_outputs=gradient_outputs,
        gradient_layouts=tuple(layouts),
        forward_seconds=forward_seconds,
        backward_seconds=backward_seconds,
        reads_updated_buffers=reads_updated,
        saved_buffer_bytes=saved_buffer_bytes,
        retained_bytes=retained_bytes,
        caller_gradients=loss_leaves,
        layer_output_bytes=layer_outputs.bytes,
        output_requires_grad=output_requires_grad,
        outputs_needing_grad=needing,
        param_grad_ids=grad_ids,
    )
    return result, out


def _outputs_needing_grad(outputs: list[torch.Tensor]) -> tuple[int, ...] | None:
    """Which output tensors need a gradient, when only some of the floating-point ones do (a
    mask made from integer ids needs none); None when all or none of them do."""
    wanted = [t.requires_grad for t in outputs]
    if not any(wanted) or wanted == [differentiable(t) for t in outputs]:
        return None
    return tuple(i for i, w in enumerate(wanted) if w)


def input_needs(result: Measured, out: Any) -> bool | list[bool]:
    """Which of the next stage's input tensors (this stage's output ``out``) need a gradient:
    one answer for all its floating-point ones, or one each (see :func:`_outputs_needing_grad`)."""
    if result.outputs_needing_grad is None:
        return result.output_requires_grad
    return [i in result.outputs_needing_grad for i in range(len(leaves(out)))]


def _layouts(wanted: list[bool], outputs: list[torch.Tensor]) -> list[bool]:
    """The layouts (``contiguous`` or not) to give a stage's output gradients: their outputs'
    own, and contiguous too when an output that gets a gradient is laid out otherwise."""
    other = any(w and not t.is_contiguous() for w, t in zip(wanted, outputs, strict=True))
    return [False, True] if other else [False]


def _backward_peak(
    module: nn.Module,
    x: Any,
    needs_grad: bool | list[bool],
    params: StageParams,
    index: int,
    *,
    kept: bool,
    contiguous: bool,
    hold: bool = False,
    last: bool = False,
) -> int:
    """The peak of one more backward of a stage (bytes above what it starts with): in the loop
    that keeps gradients (``kept``: each added in place as it is computed) or the one that
    creates them (held until the step ends); its output gradients ``contiguous`` or laid out as
    the outputs; each held by someone else until the backward ends (``hold``, and always for the
    model's last stage, whose gradient the caller holds) or handed to autograd to free."""
    made: dict[int, torch.Tensor] = {}
    existing = {i: torch.zeros_like(p) for i, p in params.params} if kept else {}

    def sink(i: int, grad: torch.Tensor) -> None:
        if kept:
            with torch.no_grad():
                existing[i].add_(grad)
        else:
            made[i] = grad if i not in made else made[i] + grad

    counter = StorageCounter()
    with counter:
        y, graph = run_forward_with_grad(
            module, x, needs_input_grad=needs_grad, params=params, sink=sink, stage=index
        )
        wanted = wanted_by_caller(graph.outputs, y) if last else list(graph.outputs)
        grad_out = _output_gradients(wanted, leaves(y), random=True, contiguous=contiguous)
        del y
        held = list(grad_out) if hold or last else []
        base = counter.reset_peak()
        run_backward(graph, grad_out)
        del graph, grad_out, held
        return counter.peak_bytes - base


def _held_backward_peaks(
    module: nn.Module,
    x: Any,
    needs_grad: bool | list[bool],
    params: StageParams,
    index: int,
    result: Measured,
) -> tuple[int, int]:
    """:attr:`Measured.backward_peaks_held` of a stage measured as ``result``: both loops'
    backward peaks with every output gradient held until the backward ends, the larger over
    the gradients' layouts."""
    again = partial(_backward_peak, module, x, needs_grad, params, index, hold=True)
    return (
        max(again(kept=False, contiguous=c) for c in result.gradient_layouts),
        max(again(kept=True, contiguous=c) for c in result.gradient_layouts),
    )


def _passed_from(grad: torch.Tensor, keys: list[int | None], freed: set[int]) -> int:
    """The output whose (still live) gradient storage ``grad`` is, else -1."""
    key = storage_key(grad)
    return next((j for j, k in enumerate(keys) if k == key and j not in freed), -1)


def _output_gradients(
    wanted: list[bool],
    tensors: list[torch.Tensor],
    *,
    random: bool = False,
    contiguous: bool = False,
) -> list[torch.Tensor | None]:
    """Gradients for a stage's output tensors, None where none flows: ones, or with ``random``
    standard-normal values (ones on meta); laid out as their tensor is, or ``contiguous``."""
    layout = torch.contiguous_format if contiguous else torch.preserve_format
    return [
        None
        if not want
        else (
            torch.randn_like(t, memory_format=layout)
            if random and t.device.type != "meta"
            else torch.ones_like(t, memory_format=layout)
        )
        for want, t in zip(wanted, tensors, strict=True)
    ]


def _passed_through_bytes(x: Any, out: Any) -> int:
    inputs = {storage_key(t) for t in leaves(x)}
    return storage_bytes([t for t in leaves(out) if storage_key(t) in inputs])


def _time_stage(
    module: nn.Module,
    x: Any,
    needs_grad: bool | list[bool],
    timer: Timer,
    index: int,
    name: str,
    params: StageParams,
) -> tuple[float, float]:
    forward: list[float] = []
    backward: list[float] = []
    for _ in range(timer.repeats):
        start = timer.clock()
        y, graph = run_forward_with_grad(
            module, x, needs_input_grad=needs_grad, params=params, stage=index, name=name
        )
        middle = timer.clock()
        run_backward(graph, _output_gradients(graph.outputs, leaves(y)))
        end = timer.clock()
        forward.append(middle - start)
        backward.append(end - middle)
        del y, graph
    return timer.summary(forward), timer.summary(backward)


def _count_flops(
    module: nn.Module,
    x: Any,
    needs_grad: bool | list[bool],
    index: int,
    name: str,
    params: StageParams,
) -> tuple[int, int]:
    counter = FlopCounterMode(display=False)
    with counter:
        y, graph = run_forward_with_grad(
            module, x, needs_input_grad=needs_grad, params=params, stage=index, name=name
        )
    forward = counter.get_total_flops()
    counter = FlopCounterMode(display=False)
    with counter:
        run_backward(graph, _output_gradients(graph.outputs, leaves(y)))
    return forward, counter.get_total_flops()


class _LayerOutputs:
    """Adds up the output bytes of the layers the paper counts (:data:`LAYER_TYPES`)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.bytes = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, _module: nn.Module, _inputs: object, output: object) -> None:
        self.bytes += sum(t.numel() * t.element_size() for t in leaves(output))

    def __enter__(self) -> _LayerOutputs:
        self._handles = [
            m.register_forward_hook(self._hook)
            for m in self.module.modules()
            if isinstance(m, LAYER_TYPES)
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
