"""The peaks of one plain-autograd training step of a whole module, forward and backward, for the
chains whose stages run as one module (:func:`with_module_step`, :func:`graph_step_peaks`), and the
state :func:`preserved` restores after profiling (buffers, gradients, the RNG state).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from edgetrain.autograd.meta_kernels import cpu_kernels
from edgetrain.autograd.meta_memo import MetaMemo
from edgetrain.autograd.stages import (
    leaves,
    stage_buffers,
)
from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.core.chain import Chain
from edgetrain.frontend.caller_gradient import wanted_by_caller
from edgetrain.frontend.meta_copies import copy_on, meta_copy, on_meta, to_meta


def with_module_step(chain: Chain, module: nn.Module, sample_input: Any) -> Chain:
    """``chain`` (of ``module``'s captured stages) with its measured plain-autograd step
    (:attr:`~edgetrain.core.chain.Chain.autograd_peak_bytes`) raised to that of ``module`` itself:
    the store-all plan runs the user's module as it is, whose ``forward()`` may keep a tensor
    longer than the captured stages do (a local). None when either cannot be measured."""
    staged = chain.autograd_peak_bytes
    if staged is None:
        return chain
    own = plain_step_peaks(module, sample_input)
    if own is None:
        return replace(chain, autograd_peak_bytes=None)
    peaks = (max(staged[0], own[0]), max(staged[1], own[1]))
    return replace(chain, autograd_peak_bytes=peaks)


@contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """Restore buffers (their values, and the tensors the modules hold: a module may assign
    itself a new one), parameter gradients and the RNG state after profiling."""
    places = stage_buffers(model.modules())
    saved = {id(b): b.detach().clone() for _, _, b in places}
    grads = [(p, p.grad) for p in model.parameters()]
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for buffers, name, buffer in places:
                buffers[name] = buffer
                buffer.copy_(saved[id(buffer)])
        for p, grad in grads:
            p.grad = grad
        torch.set_rng_state(rng)


def graph_step_peaks(module: nn.Module, sample_input: Any) -> tuple[int, int] | None:
    """:func:`plain_step_peaks` of ``module`` on the sample itself, not on meta tensors (a
    kernel may save other tensors on meta than here; attention did, see
    :mod:`edgetrain.autograd.meta_kernels`): for a module
    already run on the sample, whose step is known to fit (a plan's stages merged into one
    graph, sized by :func:`merged_chain`). Buffers, gradients and the RNG state are restored;
    the step runs on aliases of the parameters (their storage, not their hooks), so the user's
    gradient hooks do not run for it. None if the module cannot be copied so."""
    flat, spec = tree_flatten(sample_input)
    # The sample's own tensors get no gradient: leaves of their own, the same storage.
    own = [
        t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
        for t in flat
    ]
    # A twin of the module on its own buffers and on aliases of its parameters (one per tied
    # parameter). Not torch.func.functional_call: it drops the hooks of tied parameters.
    try:
        twin = copy_on(module, lambda t: t)
    except (TypeError, RuntimeError, copy.Error):
        return None  # a module deepcopy cannot copy (one holding a lock): run as counted
    with preserved(module):
        return plain_step_peaks(twin, tree_unflatten(own, spec), meta=False)


def plain_step_peaks(
    model: nn.Module, sample_input: Any, *, meta: bool = True
) -> tuple[int, int] | None:
    """Peak bytes of one training step of ``model`` as it is under plain autograd, above what
    the step starts with: ``(gradients set to None before it, gradients kept)`` (see
    :attr:`~edgetrain.core.chain.Chain.autograd_peak_bytes`).

    Measured on meta tensors (a copy of the model unless it is already there): the byte counts
    are the same, and the whole step, which may not fit in the device's memory, is never run in
    it. The output's gradient is made by the caller and held until the backward ends, as the
    plans count it. None when the model cannot be copied to or run on meta tensors: its
    store-all plan then runs stage by stage, as counted.
    """
    try:
        meta_model = model if not meta or on_meta(model) else meta_copy(model)
    except (TypeError, RuntimeError, copy.Error):
        return None  # a module deepcopy cannot copy (one holding a lock): run as counted
    x = to_meta(sample_input) if meta else sample_input
    params = list(meta_model.parameters())
    saved = [p.grad for p in params]
    peaks: list[int] = []
    try:
        for kept in (False, True):
            if not kept:
                for p in params:
                    p.grad = None
            counter = StorageCounter()
            sizing = cpu_kernels() if meta else nullcontext(set[str]())
            memo = MetaMemo() if meta else nullcontext()
            # The memo below the counter: the counter sees every storage the memo makes.
            with torch.enable_grad(), sizing as unlike_cpu, memo, counter:
                out = meta_model(x)
                wanted = wanted_by_caller([t.requires_grad for t in leaves(out)], out)
                outs = [t for t, w in zip(leaves(out), wanted, strict=True) if w]
                grads = [torch.ones_like(t) for t in outs]
                if outs:
                    torch.autograd.backward(outs, grads)
                del out, outs, grads
            if unlike_cpu:
                return None  # a layer sized on meta unlike the CPU: the plan runs as counted
            peaks.append(counter.peak_bytes)
    except (NotImplementedError, RuntimeError):
        return None  # an operation without a meta kernel: the store-all plan runs as counted
    finally:
        for p, grad in zip(params, saved, strict=True):
            p.grad = grad
    return peaks[0], peaks[1]
