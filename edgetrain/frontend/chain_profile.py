"""Profiling a whole ``nn.Sequential`` stage by stage (:func:`profile_stages`): each stage measured
(:mod:`edgetrain.frontend.stage_measure`), the bytes stages share counted once, and the measures
turned into the :class:`~edgetrain.core.chain.Stage` records of a chain.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from edgetrain import progress
from edgetrain.autograd.scratch import OpScratch, measure_scratch, scratch_of
from edgetrain.autograd.stage_grouping import group_children
from edgetrain.autograd.stage_state import buffer_copy_bytes, stage_params
from edgetrain.autograd.stages import empty_like, leaves, module_key, signature
from edgetrain.autograd.storage_counter import storage_bytes, storage_key
from edgetrain.core.chain import Chain, Stage
from edgetrain.frontend.cuts import check_sequential
from edgetrain.frontend.device_speed import DeviceSpeed
from edgetrain.frontend.meta_copies import on_meta
from edgetrain.frontend.stage_measure import (
    Measured,
    Timer,
    input_needs,
    measure_held,
    profile_stage,
)
from edgetrain.frontend.step_peaks import plain_step_peaks, preserved

NOMINAL_FLOPS = 1e9
"""Speed (floating-point operations per second) that turns analytic op counts into seconds."""


@dataclass
class StageMemo:
    """Stages sized on meta tensors, kept across :func:`profile_stages` calls on stages of one
    model at one sample (the runs of stages a plan may merge are sized over the whole model
    once per kind of candidate, see :func:`~edgetrain.frontend.profiling.merged_chain`): on
    meta tensors a stage's costs follow from what it computes, its input's shapes and how it
    is timed, so a stage sized in one call is not sized again in the next. ``measures``: a
    stage's measures, output and operator calls; ``held``: its held backward peaks (see
    :func:`~edgetrain.frontend.stage_measure.measure_held`); ``copies``: the meta copies made
    of the model's modules and tensors (see :func:`~edgetrain.frontend.meta_copies.meta_copy`),
    each copied once."""

    copies: dict[int, Any] = field(default_factory=dict)
    measures: dict[tuple[Any, ...], tuple[Measured, Any, OpScratch | None]] = field(
        default_factory=dict
    )
    held: dict[tuple[Any, ...], tuple[int, int]] = field(default_factory=dict)


def profile_stages(
    model: nn.Module,
    sample_input: Any,
    *,
    timer: Timer | None,
    flops_per_second: float = NOMINAL_FLOPS,
    flops: bool = True,
    plain_step: bool = True,
    speed: DeviceSpeed | None = None,
    scratch: bool = False,
    memo: StageMemo | None = None,
) -> Chain:
    """The chain of ``model``'s stages; ``scratch``: with each stage's kernel scratch (see
    :mod:`edgetrain.autograd.scratch`), else none; ``memo``: see :class:`StageMemo`."""
    check_sequential(model)
    assert isinstance(model, nn.Sequential)
    measured: list[tuple[str, nn.Module, int, Measured]] = []
    # Identical stages on meta tensors (a ResNet's repeated blocks) are sized once: StageMemo.
    memo = memo if memo is not None and timer is None else StageMemo()
    timing = (flops_per_second if flops else 0.0, None if speed is None else id(speed), scratch)
    calls: list[OpScratch | None] = []  # each stage's kinds of operator call
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    what = f"{'measuring' if timer is not None else 'sizing'} the stages of {type(model).__name__}"
    if timer is None and on_meta(model):
        what += " on meta tensors" + (" (times from FLOPs)" if speed or flops else "")
    with preserved(model), progress.task(what) as done:
        groups = group_children(model, sample_input)
        x = sample_input
        needs_grad: bool | list[bool] = any(t.requires_grad for t in leaves(sample_input))
        # Stages with two or more output gradients, until it is known whether the step gives
        # two of them one storage (see _gradients_shared): what their held passes need then.
        pending: dict[int, tuple[Any, bool | list[bool], tuple[Any, ...] | None]] = {}
        for index, (name, module, span) in enumerate(groups):
            done(detail=name)
            last = index == len(groups) - 1
            key = (module_key(module), signature(x), str(needs_grad), last, timing)
            stage_input, stage_needs = x, needs_grad
            if timer is None and key in memo.measures and not _shares_parameters(module, measured):
                known, out, ops = memo.measures[key]
                # The twin's parameters all got gradients, or none did: so do this one's.
                trainable = {id(p) for p in module.parameters() if p.requires_grad}
                result = replace(known, param_grad_ids=trainable if known.param_grad_ids else set())
                x = empty_like(out)
            else:
                ops = OpScratch() if scratch else None
                result, x = profile_stage(
                    name,
                    module,
                    x,
                    needs_grad,
                    timer,
                    flops_per_second if flops else 0.0,
                    index,
                    stage_params(module, index_of),
                    last,
                    speed,
                    ops,
                )
                if timer is None:
                    memo.measures[key] = (result, x, ops)
            measured.append((name, module, span, result))
            calls.append(ops)
            needs_grad = input_needs(result, x)
            if result.gradient_outputs > 1 and not last:
                # Its held peaks serve its twins (identical stages on meta tensors) too.
                twin = timer is None and not _shares_parameters(module, measured[:-1])
                pending[index] = (stage_input, stage_needs, key if twin else None)
            del stage_input
            measure_held(measured, pending, memo.held, index_of, complete=last)
        done(detail="one step of plain autograd")
        autograd_peaks = plain_step_peaks(model, sample_input) if plain_step else None
        if scratch:
            done(detail="the kernels' scratch")
            measured = _with_scratch(measured, calls)
    stages = stage_records(measured)
    return Chain(
        stages=tuple(stages),
        input_bytes=storage_bytes(leaves(sample_input)),
        input_requires_grad=any(t.requires_grad for t in leaves(sample_input)),
        name=type(model).__name__,
        autograd_peak_bytes=autograd_peaks,
    )


def _with_scratch(
    measured: list[tuple[str, nn.Module, int, Measured]], calls: list[OpScratch | None]
) -> list[tuple[str, nn.Module, int, Measured]]:
    """Each stage's measures with its kernel scratch: the most any kind of call of its forward,
    and of its backward, takes (each kind measured once, see :mod:`edgetrain.autograd.scratch`)."""
    pending = {}
    for ops in calls:
        if ops is not None:
            pending.update(ops.pending)
    measure_scratch(pending)
    return [
        (name, module, span, r)
        if ops is None
        else (
            name,
            module,
            span,
            replace(
                r,
                forward_scratch_bytes=scratch_of(ops.forward),
                backward_scratch_bytes=scratch_of(ops.backward),
            ),
        )
        for (name, module, span, r), ops in zip(measured, calls, strict=True)
    ]


def _shares_parameters(module: nn.Module, measured: list[tuple[str, nn.Module, int, Any]]) -> bool:
    mine = {id(p) for p in module.parameters()}
    return any(mine & {id(p) for p in m.parameters()} for _, m, _, _ in measured)


def stage_records(measured: list[tuple[str, nn.Module, int, Measured]]) -> list[Stage]:
    """Stages with weights and buffers counted where first used and gradients where first
    created; each stage's buffer copies (what a recomputation copies) count all its buffers."""
    weights_seen: set[int] = set()
    buffers_seen: set[int] = set()
    weights: list[int] = []
    buffers: list[int] = []
    for _, module, _, _ in measured:
        weights.append(_new_bytes(module.parameters(), weights_seen))
        buffers.append(_new_storage_bytes(module.buffers(), buffers_seen))
    grads_seen: set[int] = set()
    created = [0] * len(measured)
    shared = [0] * len(measured)
    summed = [0] * len(measured)
    own = [0] * len(measured)
    first_graded: dict[int, int] = {}  # parameter -> the first stage that gave it a gradient
    for k, (_, _, _, result) in enumerate(measured):
        for key in result.param_grad_ids:
            first_graded.setdefault(key, k)
    for k in reversed(range(len(measured))):
        _, module, _, result = measured[k]
        fresh = [p for p in module.parameters() if id(p) in result.param_grad_ids]
        # A gradient a later stage created (a tied weight) is summed with this stage's out of
        # place, in either loop (see Stage.shared_gradient_bytes): one more of it during the
        # backward.
        summed[k] = sum(p.numel() * p.element_size() for p in fresh if id(p) in grads_seen)
        shared[k] = sum(
            p.numel() * p.element_size()
            for p in fresh
            if id(p) not in grads_seen and first_graded[id(p)] < k
        )
        created[k] = _new_bytes(iter(fresh), grads_seen)
        # The stage's backward in a loop that keeps gradients holds at least what it holds when
        # they are created, less those gradients (added in place instead). The pass measured so
        # can read less: a parameterless stage reading its input three times (softmax(q @ hᵀ)
        # @ h) read 10 KiB less than the first pass, and the executor's backward of it holds
        # what the first pass read.
        own[k] = sum(p.numel() * p.element_size() for p in fresh)
    backward_peaks = [
        r.backward_peaks_held or (r.backward_peak_bytes, r.backward_peak_kept_bytes)
        for _, _, _, r in measured
    ]
    return [
        Stage(
            name=name,
            output_bytes=r.output_bytes,
            saved_bytes=r.saved_bytes,
            saves_input=r.saves_input,
            saves_output=r.saves_output,
            forward_peak_bytes=r.forward_peak_bytes,
            forward_grad_peak_bytes=r.forward_grad_peak_bytes,
            backward_peak_bytes=backward_peaks[k][0] + summed[k],
            backward_peak_kept_bytes=max(backward_peaks[k][1], backward_peaks[k][0] - own[k])
            + summed[k],
            weight_bytes=weights[k],
            gradient_bytes=created[k],
            shared_gradient_bytes=shared[k],
            forward_seconds=r.forward_seconds,
            backward_seconds=r.backward_seconds,
            layer_output_bytes=r.layer_output_bytes,
            buffer_bytes=buffers[k],
            copied_buffer_bytes=buffer_copy_bytes(module),
            saved_buffer_bytes=r.saved_buffer_bytes,
            span=span,
            output_requires_grad=r.output_requires_grad,
            outputs_needing_grad=r.outputs_needing_grad,
            leaf_bytes=r.leaf_bytes,
            carried=r.carried,
            shared_leaves=r.shared_leaves,
            saved_inputs=r.saved_inputs,
            saved_outputs=r.saved_outputs,
            input_gradient_bytes=r.input_gradient_bytes,
            gradient_from=r.gradient_from,
            reads_updated_buffers=r.reads_updated_buffers,
            retained_bytes=r.retained_bytes,
            forward_scratch_bytes=r.forward_scratch_bytes,
            backward_scratch_bytes=r.backward_scratch_bytes,
            caller_gradients=r.caller_gradients,
        )
        for k, (name, module, span, r) in enumerate(measured)
    ]


def _new_bytes(tensors: Iterator[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _new_storage_bytes(tensors: Iterator[torch.Tensor], seen: set[int]) -> int:
    """:func:`_new_bytes` by storage: a tensor whose storage an earlier one holds is not
    counted again (two buffers that view one storage: a constant capture makes of one tensor
    that two layers read)."""
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
