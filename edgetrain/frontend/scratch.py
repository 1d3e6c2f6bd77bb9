"""The scratch a stage's kernels take beyond its tensors, from the allocator's own record.

A convolution's workspace (``im2col`` columns, a depthwise kernel's buffers), an attention
kernel's blocks: memory a kernel allocates for itself and frees before it returns, which no
tensor holds and :class:`~edgetrain.autograd.storage_counter.StorageCounter` therefore does not
see. :func:`scratch_bytes` runs the stage's forward with grad and its backward again under the
torch profiler with ``profile_memory=True``, whose allocator events record every allocation and
free of torch's CPU allocator in order (the kernels' own buffers and oneDNN's scratchpads
included), and takes the running total's peak above the exact tensor peak measured before
(``Stage.forward_grad_peak_bytes``, ``Stage.backward_peak_bytes``): what the heap needs beyond
the tensors while the stage runs. Unlike sampling the heap
(:class:`~edgetrain.autograd.heap.HeapPeak`, which misses a forward kernel that holds the GIL),
the record misses nothing. Each pass runs :data:`REPEATS` times and the most it took counts: the
first run of a kernel may set up buffers a later one reuses, and a kernel may pick another
algorithm on a later call. 0 on meta tensors (no memory) and while another profiler runs (the
profiler does not nest).

A chain sized on meta tensors (``profile_chain(timing="modelled")``) has no scratch: meta tensors
take no memory. :func:`with_device_scratch` adds it, from one real forward with grad and one
backward per stage on the sample's device (identical stages, the repeated blocks of a ResNet,
once), the tensor peaks taken from the chain.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from edgetrain.autograd.stages import (
    StageParams,
    group_children,
    leaves,
    module_key,
    run_backward,
    run_forward,
    run_forward_with_grad,
    signature,
    stage_params,
)
from edgetrain.core.chain import Chain

REPEATS = 2
"""Runs of each stage's forward and backward under the profiler; the largest peak counts."""


def scratch_bytes(
    module: nn.Module,
    x: Any,
    *,
    needs_grad: bool,
    params: StageParams,
    index: int,
    tensor_peaks: tuple[int, int],
    held_output_gradients: bool,
    repeats: int = REPEATS,
) -> tuple[int, int]:
    """``(forward, backward)`` scratch of one stage: the allocator's peak during its forward
    with grad and during its backward, above ``tensor_peaks`` (the exact tensor peaks of those
    calls, measured in the same conditions: parameter gradients created, the output gradients
    handed to autograd to free, or held by the caller when ``held_output_gradients``)."""
    if any(t.device.type == "meta" for t in leaves(x)):
        return 0, 0
    forward = backward = 0
    for _ in range(repeats):
        peaks = _allocator_peaks(module, x, needs_grad, params, index, held_output_gradients)
        if peaks is None:
            return 0, 0
        forward, backward = max(forward, peaks[0]), max(backward, peaks[1])
    return max(0, forward - tensor_peaks[0]), max(0, backward - tensor_peaks[1])


def with_device_scratch(model: nn.Module, sample_input: Any, chain: Chain) -> Chain:
    """``chain`` (``model``'s, sized on meta tensors: the same stages, no scratch) with each
    stage's scratch measured on the sample's device by one forward with grad and its backward
    (:func:`scratch_bytes` with one repeat). ``chain`` as it is when the sample is on meta
    tensors or the stages do not match. The caller restores what the runs change (buffers,
    gradients, the RNG state)."""
    if any(t.device.type == "meta" for t in leaves(sample_input)):
        return chain
    groups = group_children(model, sample_input)
    if len(groups) != chain.length:
        return chain
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    needs_grad = any(t.requires_grad for t in leaves(sample_input))
    known: dict[tuple[Any, ...], tuple[int, int]] = {}
    stages = []
    x = sample_input
    for index, ((_, module, _), stage) in enumerate(zip(groups, chain.stages, strict=True)):
        last = index == chain.length - 1
        key = (module_key(module), signature(x), needs_grad, last)
        if key not in known:
            known[key] = scratch_bytes(
                module,
                x,
                needs_grad=needs_grad,
                params=stage_params(module, index_of),
                index=index,
                tensor_peaks=(stage.forward_grad_peak_bytes, stage.backward_peak_bytes),
                held_output_gradients=last,
                repeats=1,
            )
        forward, backward = known[key]
        stages.append(
            replace(stage, forward_scratch_bytes=forward, backward_scratch_bytes=backward)
        )
        needs_grad = stage.output_requires_grad
        if not last:
            x = run_forward(module, x, stage=index)
    return replace(chain, stages=tuple(stages))


def _allocator_peaks(
    module: nn.Module,
    x: Any,
    needs_grad: bool,
    params: StageParams,
    index: int,
    held: bool,
) -> tuple[int, int] | None:
    """The allocator's peaks (bytes above its start) of one forward with grad and of its
    backward; None while another profiler runs."""
    made: dict[int, torch.Tensor] = {}

    def sink(i: int, grad: torch.Tensor) -> None:
        made[i] = grad if i not in made else made[i] + grad

    def forward() -> tuple[Any, Any]:
        return run_forward_with_grad(
            module, x, needs_input_grad=needs_grad, params=params, sink=sink, stage=index
        )

    forward_peak, (y, graph) = allocator_peak(forward)
    if forward_peak is None:
        return None
    grads = [
        torch.randn_like(t) if want else None
        for want, t in zip(graph.outputs, leaves(y), strict=True)
    ]
    del y
    kept = list(grads) if held else []
    backward_peak, _ = allocator_peak(partial(run_backward, graph, grads))
    del graph, grads, kept
    made.clear()
    if backward_peak is None:
        return None
    return forward_peak, backward_peak


def allocator_peak(call: Callable[[], Any]) -> tuple[int | None, Any]:
    """The peak of torch's CPU allocator's running total during ``call()`` (bytes above its
    start, every allocation and free in order from the profiler's record) and ``call()``'s
    result; None for the peak, ``call()`` run all the same, while another profiler runs."""
    # Kineto logs each start and stop of a profiler on stderr at its default level.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        recorder = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        recorder.__enter__()
    except RuntimeError:
        return None, call()
    try:
        result = call()
    finally:
        recorder.__exit__(None, None, None)
    try:
        events = recorder.profiler.kineto_results.events()  # type: ignore[union-attr]
    except AttributeError:
        return None, result
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    total = peak = 0
    for event in memory:
        total += event.nbytes()
        peak = max(peak, total)
    return peak, result
