"""From an ``nn.Sequential`` to a :class:`~edgetrain.core.chain.Chain`: measured or from shapes
alone.

* :func:`profile_chain` runs each stage on this device: memory from what autograd really keeps
  (tensor storages, each counted once) and the transient peaks, time as the least process CPU
  time of several runs.
* :func:`analytic_chain` does the same memory accounting on ``meta`` tensors (shapes, no data), so a
  user can plan for a device they do not have; its times are estimates from floating-point
  operation counts at a nominal speed (:data:`NOMINAL_FLOPS`), good for relative costs only.

Both measure memory with :class:`~edgetrain.autograd.storage_counter.StorageCounter` and run stages
exactly as the
executor does (:mod:`edgetrain.autograd.stages`), so a measured chain and its analytic twin agree
on every
byte count, and both agree with what :class:`~edgetrain.runtime.checkpointed.Checkpointed` then
holds.
Profiling leaves the model as it found it: BatchNorm statistics, gradients and the RNG state are
restored afterwards.
"""

from __future__ import annotations

import copy
import itertools
import operator
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from edgetrain import progress
from edgetrain.autograd.buffer_state import BufferFlow
from edgetrain.autograd.meta_kernels import cpu_kernels
from edgetrain.autograd.meta_memo import MetaMemo
from edgetrain.autograd.replay import AutocastState, autocast_label, autocasting
from edgetrain.autograd.stages import (
    StageParams,
    buffer_copy_bytes,
    empty_like,
    group_children,
    leaves,
    module_key,
    run_backward,
    run_forward,
    run_forward_with_grad,
    signature,
    stage_buffers,
    stage_params,
)
from edgetrain.autograd.storage_counter import StorageCounter, storage_bytes, storage_key
from edgetrain.core.chain import Chain, Stage
from edgetrain.errors import InvalidInput
from edgetrain.frontend.cuts import as_stages, check_sequential, on_stage_input, stage_input
from edgetrain.frontend.device_speed import DeviceSpeed, OpSeconds, device_speed

NOMINAL_FLOPS = 1e9
"""Speed (floating-point operations per second) that turns analytic op counts into seconds."""

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


def profile_chain(
    model: nn.Module,
    sample_input: Any,
    *,
    repeats: int = 3,
    autocast: AutocastState | None = None,
    timing: str = "measured",
) -> Chain:
    """Measure ``model`` (an ``nn.Sequential``) on ``sample_input`` on this device.

    Each child is one stage (children that return a view of their input or change it in place are
    merged with a neighbour, see :func:`edgetrain.autograd.stages.group_children`). Time is the
    least
    process CPU time (seconds) of ``repeats`` runs of each stage's forward (with grad) and
    backward (see :class:`_Timer`). ``autocast``: the ``torch.autocast`` state the steps run
    under (:func:`~edgetrain.autograd.replay.autocast_state`); each stage is measured under it, as
    the
    executor runs it (:func:`~edgetrain.autograd.replay.autocasting`). Its plain-autograd step is
    not
    measured then (it is on meta tensors, which autocast does not cast): the store-all plan runs
    stage by stage, as counted.

    ``timing="modelled"``: each stage is sized on meta tensors (the same byte counts, see
    :func:`analytic_chain`) and timed by :class:`~edgetrain.frontend.device_speed.DeviceSpeed`,
    this machine's speed measured once, in seconds instead of minutes; a model that cannot be
    sized so (an operator without a meta kernel, a layer sized unlike the CPU, autocast) is
    measured, as the progress line says.
    """
    if timing not in ("measured", "modelled"):
        raise InvalidInput(f"timing must be 'measured' or 'modelled', got {timing!r}")
    if timing == "modelled":
        modelled = _modelled(model, sample_input) if not autocast else "autocast"
        if isinstance(modelled, Chain):
            return modelled
        progress.note(f"measuring the stages of {type(model).__name__}: {modelled}")
    if not autocast:
        chain = _profile(model, sample_input, timer=_Timer(repeats))
        return chain if _sized_alike_on_meta(chain, model, sample_input) else _unsized(chain)
    with autocasting(autocast):
        chain = _profile(model, sample_input, timer=_Timer(repeats), plain_step=False)
    return replace(chain, autocast=autocast_label(autocast))


def analytic_chain(
    model: nn.Module,
    sample_input: Any,
    *,
    flops_per_second: float = NOMINAL_FLOPS,
    timing: bool = True,
) -> Chain:
    """The chain of ``model`` from shapes alone, on meta tensors: no data, no timing.

    ``model`` is an ``nn.Sequential`` (its children are the stages) or any module torch.fx can
    trace, captured and cut into stages as :class:`~edgetrain.runtime.checkpointed.Checkpointed`
    cuts it
    (:func:`~edgetrain.frontend.cuts.as_stages`); a captured chain's stages are named for
    the first
    and last operation they run (``layer1.0.conv1..layer1.0.bn1``). ``sample_input`` may be a
    meta tensor (``torch.empty(shape, device="meta")``) or a real one (only its shape, dtype and
    ``requires_grad`` are used; a model with a ``forward()`` on real weights is captured by
    running it once without grad on it). The model is copied to the meta device unless it is
    already there. Stage times are FLOP counts over ``flops_per_second``; ``timing=False`` skips
    the FLOP count (stage times are then 0), enough for memory tables.
    """
    return _analytic(model, sample_input, flops_per_second=flops_per_second, flops=timing)


def _modelled(model: nn.Module, sample_input: Any) -> Chain | str:
    """:func:`profile_chain`'s chain sized on meta tensors and timed by this machine's
    :func:`~edgetrain.frontend.device_speed.device_speed`, or why it cannot be sized so."""
    recurrent = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.RNNBase)})
    if recurrent:  # known before sizing: see edgetrain.autograd.meta_kernels
        return f"its nn.{', nn.'.join(recurrent)} holds other sizes on meta tensors"
    speed = device_speed()
    try:
        twin = _meta_copy(model)
        with cpu_kernels() as unlike_cpu, MetaMemo():
            chain = _profile(twin, _to_meta(sample_input), timer=None, speed=speed)
    except (TypeError, NotImplementedError, RuntimeError, InvalidInput, copy.Error) as exc:
        return f"not sized on meta tensors ({str(exc).splitlines()[0][:80]})"
    if unlike_cpu:
        return f"its {', '.join(sorted(unlike_cpu))} holds other sizes on meta tensors"
    return replace(chain, name=type(model).__name__)


def _sized_alike_on_meta(chain: Chain, model: nn.Module, sample_input: Any) -> bool:
    """Whether ``model``'s stages, sized on meta tensors, hold what ``chain`` measured of them
    on the sample's device: only then does the plain-autograd step sized on meta
    (:attr:`~edgetrain.core.chain.Chain.autograd_peak_bytes`) stand for the step here.

    Meta tensors run some operations with other kernels than the CPU's: an ``nn.LSTM``'s
    generic cells save about half what the CPU's oneDNN kernel saves (a 2-layer LSTM's plain step
    read 344 KB on meta where it holds 615 KB), and ``mish``'s backward is decomposed into five
    tensors' worth where the CPU's kernel makes one. The stages' own sizes are measured here,
    so only the plain step can be off; where a stage differs, it is not taken."""
    if chain.autograd_peak_bytes is None or _any_meta(sample_input):
        return True
    try:
        twin = _meta_copy(model)
    except (TypeError, RuntimeError, copy.Error):
        return False
    try:
        with cpu_kernels() as unlike_cpu, MetaMemo():
            sized = _profile(
                twin, _to_meta(sample_input), timer=None, flops=False, plain_step=False
            )
    except (NotImplementedError, RuntimeError, InvalidInput):
        return False  # not sized on meta stage by stage: nor is the plain step taken
    return not unlike_cpu and sized.fingerprint() == chain.fingerprint()


def _unsized(chain: Chain) -> Chain:
    """``chain`` without its plain-autograd step: the store-all plan then runs stage by stage,
    as counted (see :attr:`~edgetrain.core.chain.Chain.autograd_peak_bytes`)."""
    return replace(chain, autograd_peak_bytes=None)


def _analytic(
    model: nn.Module, sample_input: Any, *, flops_per_second: float, flops: bool
) -> Chain:
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"edgetrain plans an nn.Module, got {type(model).__name__}")
    if _on_meta(model) or _any_meta(sample_input):
        model = model if _on_meta(model) else _meta_copy(model)
        sample_input = _to_meta(sample_input)
    stages = as_stages(model, sample_input)
    sample_input = stage_input(stages, sample_input)  # keyword inputs as the stages take them
    meta_model = stages if _on_meta(stages) else _meta_copy(stages)
    with cpu_kernels() as unlike_cpu, MetaMemo():
        chain = _profile(
            meta_model,
            _to_meta(sample_input),
            timer=None,
            flops_per_second=flops_per_second,
            flops=flops,
        )
    if unlike_cpu:
        layers = ", ".join(sorted(unlike_cpu))
        raise InvalidInput(
            f"{type(model).__name__} cannot be sized from shapes: its {layers} holds other "
            "sizes on meta tensors than on the CPU (an LSTM's step read 44 % low); profile it on "
            "the device instead (Checkpointed(model, x) without chain=, or edgetrain.profile_chain)"
        )
    if stages is model:
        return chain
    return replace(
        with_module_step(chain, on_stage_input(model, stages), sample_input),
        stages=tuple(_segment_names(stages, chain)),
        name=type(model).__name__,
    )


def merged_chain(
    chain: Chain, modules: list[nn.Module], first: list[int], sample_input: Any
) -> Chain | None:
    """``chain`` with some runs of its stages merged: ``modules`` are the stages as they will run
    (a merged run one ``nn.Sequential`` of its stages), ``first[c]`` the stage of ``chain`` that
    ``modules[c]`` begins with. A merged stage runs as one autograd graph, which may hold more or
    less at its backward's peak than its stages one by one (as plain autograd's step differs
    from the stage-by-stage plan's: :attr:`~edgetrain.core.chain.Chain.autograd_peak_bytes`), so its
    sizes are measured on the sample (as :func:`profile_chain` measures them, without timing); its
    times are the sum of its stages'. The other stages are ``chain``'s. None if the merged
    stages cannot be sized so (they do not stay one stage each).

    Sized on meta tensors, with the kernels the CPU picks (:func:`cpu_kernels`), when that sizes
    them as the device would; else (autocast, which meta tensors do not follow, or a layer
    sized unlike the CPU) on the sample's own device, as the executor will run them."""
    bounds = [*first, chain.length]
    # Its own stages only: the chain's plain step does not apply to it (set to None below).
    sized = _sized_on_meta(nn.Sequential(*modules), sample_input)
    if sized is None:
        sized = _profile(
            nn.Sequential(*modules), sample_input, timer=None, flops=False, plain_step=False
        )
    if sized.length != len(modules):
        return None
    stages = []
    for c, (start, stop) in enumerate(itertools.pairwise(bounds)):
        if stop - start == 1:
            stages.append(chain.stages[start])
            continue
        span = chain.stages[start:stop]
        stages.append(
            replace(
                sized.stages[c],
                name="+".join(s.name for s in span),
                span=sum(s.span for s in span),
                forward_seconds=sum(s.forward_seconds for s in span),
                backward_seconds=sum(s.backward_seconds for s in span),
            )
        )
    return replace(chain, stages=tuple(stages), autograd_peak_bytes=None)


def _sized_on_meta(model: nn.Module, sample_input: Any) -> Chain | None:
    """``model``'s stages sized (not timed) on meta tensors; None where meta tensors would not
    size them as the sample's device runs them (see :func:`merged_chain`)."""
    if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        return None
    try:
        twin = _meta_copy(model)
        with cpu_kernels() as unlike_cpu, MetaMemo():
            sized = _profile(
                twin, _to_meta(sample_input), timer=None, flops=False, plain_step=False
            )
    except (TypeError, NotImplementedError, RuntimeError, InvalidInput, copy.Error):
        return None
    return None if unlike_cpu else sized


def with_module_step(chain: Chain, module: nn.Module, sample_input: Any) -> Chain:
    """``chain`` (of ``module``'s captured stages) with its measured plain-autograd step
    (:attr:`~edgetrain.core.chain.Chain.autograd_peak_bytes`) raised to that of ``module`` itself:
    the store-all plan runs the user's module as it is, whose ``forward()`` may keep a tensor
    longer than the captured stages do (a local). None when either cannot be measured."""
    staged = chain.autograd_peak_bytes
    if staged is None:
        return chain
    own = _autograd_peaks(module, sample_input)
    if own is None:
        return replace(chain, autograd_peak_bytes=None)
    peaks = (max(staged[0], own[0]), max(staged[1], own[1]))
    return replace(chain, autograd_peak_bytes=peaks)


def _to_meta(sample_input: Any) -> Any:
    flat, spec = tree_flatten(sample_input)
    return tree_unflatten([_meta_like(t) if isinstance(t, torch.Tensor) else t for t in flat], spec)


def _any_meta(sample_input: Any) -> bool:
    return any(t.device.type == "meta" for t in leaves(sample_input))


def _segment_names(stages: nn.Sequential, chain: Chain) -> Iterator[Stage]:
    """The chain's stages renamed for the first and last operation of the captured segments
    each runs (a stage may run several consecutive segments, see ``Stage.span``)."""
    segments = [m for m in stages._modules.values() if m is not None]
    start = 0
    for stage in chain.stages:
        operations = [
            name
            for segment in segments[start : start + stage.span]
            for name in _operations(segment)
        ]
        start += stage.span
        if not operations:
            yield stage
            continue
        first, last = operations[0], operations[-1]
        yield stage.renamed(first if first == last else f"{first}..{last}")


def _operations(segment: nn.Module) -> list[str]:
    """The operations an fx segment runs, by module path, function or method name (the
    unpacking of its input tuple left out)."""
    graph = getattr(segment, "graph", None)
    if graph is None:
        return []
    names = []
    for node in graph.nodes:
        if node.op == "call_module" or node.op == "call_method":
            names.append(str(node.target))
        elif node.op == "call_function":
            if node.target is operator.getitem and node.args[0].op == "placeholder":
                continue
            names.append(getattr(node.target, "__name__", str(node.target)))
    return names


def _meta_copy(model: nn.Module) -> nn.Module:
    """The model with every parameter and buffer on the meta device, without copying data; a
    tensor shared by several modules (a tied weight) stays one tensor. An integer scalar buffer
    (a counter such as ``num_batches_tracked``) is copied as it is: a forward may read its value
    (``1 / float(self.num_batches_tracked)``), which a meta tensor has not."""

    def meta_unless_counter(t: torch.Tensor) -> torch.Tensor:
        counter = t.dim() == 0 and not t.is_floating_point() and not t.is_complex()
        return t.detach().clone() if counter else _meta_like(t)

    return _copy_on(model, meta_unless_counter)


def _copy_on(model: nn.Module, tensor: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A deep copy of the model whose parameters are new ``nn.Parameter`` s over
    ``tensor(p.detach())`` (none of the originals' hooks) and whose buffers are ``tensor(b)``;
    a tensor shared by several modules (a tied weight) stays one tensor."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(tensor(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = tensor(b)
    # A tensor a module keeps as a plain attribute: the older weight_norm and spectral_norm
    # hooks set the weight they compute, which (not a leaf) deepcopy refuses.
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = tensor(value.detach())
    return copy.deepcopy(model, memo)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return out.requires_grad_(t.requires_grad)


def _on_meta(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


class _Timer:
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


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
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


def _profile(
    model: nn.Module,
    sample_input: Any,
    *,
    timer: _Timer | None,
    flops_per_second: float = NOMINAL_FLOPS,
    flops: bool = True,
    plain_step: bool = True,
    speed: DeviceSpeed | None = None,
) -> Chain:
    check_sequential(model)
    assert isinstance(model, nn.Sequential)
    measured: list[tuple[str, nn.Module, int, _Measured]] = []
    # On meta tensors a stage's costs follow from its structure and input shape alone, so
    # identical stages (the repeated blocks of a ResNet) are profiled once.
    memo: dict[tuple[str, str, bool, bool], tuple[_Measured, Any]] = {}
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    what = f"{'measuring' if timer is not None else 'sizing'} the stages of {type(model).__name__}"
    if timer is None and _on_meta(model):
        what += " on meta tensors" + (" (times from FLOPs)" if speed or flops else "")
    with _preserved(model), progress.task(what) as done:
        groups = group_children(model, sample_input)
        x = sample_input
        needs_grad = any(t.requires_grad for t in leaves(sample_input))
        # Stages with two or more output gradients, until it is known whether the step gives
        # two of them one storage (see _gradients_shared): what their held passes need then.
        pending: dict[int, tuple[Any, bool, tuple[Any, ...] | None]] = {}
        held_memo: dict[tuple[Any, ...], tuple[int, int]] = {}
        for index, (name, module, span) in enumerate(groups):
            done(detail=name)
            last = index == len(groups) - 1
            key = (module_key(module), signature(x), needs_grad, last)
            stage_input, stage_needs = x, needs_grad
            if timer is None and key in memo and not _shares_parameters(module, measured):
                known, out = memo[key]
                # The twin's parameters all got gradients, or none did: so do this one's.
                trainable = {id(p) for p in module.parameters() if p.requires_grad}
                result = replace(known, param_grad_ids=trainable if known.param_grad_ids else set())
                x = empty_like(out)
            else:
                result, x = _profile_stage(
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
                )
                if timer is None:
                    memo[key] = (result, x)
            measured.append((name, module, span, result))
            needs_grad = result.output_requires_grad
            if result.gradient_outputs > 1 and not last:
                # Its held peaks serve its twins (identical stages on meta tensors) too.
                twin = timer is None and not _shares_parameters(module, measured[:-1])
                pending[index] = (stage_input, stage_needs, key if twin else None)
            del stage_input
            _measure_held(measured, pending, held_memo, index_of, complete=last)
        done(detail="one step of plain autograd")
        autograd_peaks = _autograd_peaks(model, sample_input) if plain_step else None
    stages = _stages(measured)
    return Chain(
        stages=tuple(stages),
        input_bytes=storage_bytes(leaves(sample_input)),
        input_requires_grad=any(t.requires_grad for t in leaves(sample_input)),
        name=type(model).__name__,
        autograd_peak_bytes=autograd_peaks,
    )


def graph_step_peaks(module: nn.Module, sample_input: Any) -> tuple[int, int] | None:
    """:func:`_autograd_peaks` of ``module`` on the sample itself, not on meta tensors (a
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
        twin = _copy_on(module, lambda t: t)
    except (TypeError, RuntimeError, copy.Error):
        return None  # a module deepcopy cannot copy (one holding a lock): run as counted
    with _preserved(module):
        return _autograd_peaks(twin, tree_unflatten(own, spec), meta=False)


def _autograd_peaks(
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
        meta_model = model if not meta or _on_meta(model) else _meta_copy(model)
    except (TypeError, RuntimeError, copy.Error):
        return None  # a module deepcopy cannot copy (one holding a lock): run as counted
    x = _to_meta(sample_input) if meta else sample_input
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
                outs = [t for t in leaves(out) if t.requires_grad]
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


def _shares_parameters(module: nn.Module, measured: list[tuple[str, nn.Module, int, Any]]) -> bool:
    mine = {id(p) for p in module.parameters()}
    return any(mine & {id(p) for p in m.parameters()} for _, m, _, _ in measured)


@dataclass(frozen=True)
class _Measured:
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
    gradient_outputs: int = 0  # output tensors a gradient flows to
    gradient_layouts: tuple[bool, ...] = (False,)  # see _layouts
    # (backward_peak_bytes, backward_peak_kept_bytes) with every output gradient held until
    # the backward ends: measured (by _profile) only where two of them share one storage.
    backward_peaks_held: tuple[int, int] | None = None
    reads_updated_buffers: bool = False
    retained_bytes: int = 0


def _stages(measured: list[tuple[str, nn.Module, int, _Measured]]) -> list[Stage]:
    """Stages with weights and buffers counted where first used and gradients where first
    created; each stage's buffer copies (what a recomputation copies) count all its buffers."""
    weights_seen: set[int] = set()
    buffers_seen: set[int] = set()
    weights: list[int] = []
    buffers: list[int] = []
    for _, module, _, _ in measured:
        weights.append(_new_bytes(module.parameters(), weights_seen))
        buffers.append(_new_bytes(module.buffers(), buffers_seen))
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
            span=span,
            output_requires_grad=r.output_requires_grad,
            leaf_bytes=r.leaf_bytes,
            carried=r.carried,
            shared_leaves=r.shared_leaves,
            saved_inputs=r.saved_inputs,
            saved_outputs=r.saved_outputs,
            input_gradient_bytes=r.input_gradient_bytes,
            gradient_from=r.gradient_from,
            reads_updated_buffers=r.reads_updated_buffers,
            retained_bytes=r.retained_bytes,
        )
        for k, (name, module, span, r) in enumerate(measured)
    ]


def _measure_held(
    measured: list[tuple[str, nn.Module, int, _Measured]],
    pending: dict[int, tuple[Any, bool, tuple[Any, ...] | None]],
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
    measured: list[tuple[str, nn.Module, int, _Measured]], *, complete: bool = True
) -> list[bool | None]:
    """Per stage, whether two of its output tensors get one gradient storage in the step: the
    next stage's backward passes an output gradient of its own on to both (an addition of the
    trunk and this stage's branch), or to tensors that later get one so. The storage then lives
    until the stage's backward ends (see :attr:`_Measured.backward_peaks_held`).

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


def _new_bytes(tensors: Iterator[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _profile_stage(
    name: str,
    module: nn.Module,
    x: Any,
    needs_grad: bool,
    timer: _Timer | None,
    flops_per_second: float,
    index: int,
    params: StageParams,
    last: bool = False,
    speed: DeviceSpeed | None = None,
) -> tuple[_Measured, Any]:
    counter = StorageCounter()
    layer_outputs = _LayerOutputs(module)
    with counter:
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
        del y, new_out
        kept = counter.live_bytes - base
        saved_out_leaves = tuple(i for i, key in enumerate(out_keys) if key in saved)
        saved_in_leaves = tuple(j for j, key in enumerate(in_keys) if key in saved)
        saves_output = bool(saved_out_leaves)

        out_leaves = leaves(out)
        wanted = list(graph.outputs)
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
    result = _Measured(
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
        retained_bytes=retained_bytes,
        layer_output_bytes=layer_outputs.bytes,
        output_requires_grad=output_requires_grad,
        param_grad_ids=grad_ids,
    )
    return result, out


def _layouts(wanted: list[bool], outputs: list[torch.Tensor]) -> list[bool]:
    """The layouts (``contiguous`` or not) to give a stage's output gradients: their outputs'
    own, and contiguous too when an output that gets a gradient is laid out otherwise."""
    other = any(w and not t.is_contiguous() for w, t in zip(wanted, outputs, strict=True))
    return [False, True] if other else [False]


def _backward_peak(
    module: nn.Module,
    x: Any,
    needs_grad: bool,
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
        grad_out = _output_gradients(graph.outputs, leaves(y), random=True, contiguous=contiguous)
        del y
        held = list(grad_out) if hold or last else []
        base = counter.reset_peak()
        run_backward(graph, grad_out)
        del graph, grad_out, held
        return counter.peak_bytes - base


def _held_backward_peaks(
    module: nn.Module, x: Any, needs_grad: bool, params: StageParams, index: int, result: _Measured
) -> tuple[int, int]:
    """:attr:`_Measured.backward_peaks_held` of a stage measured as ``result``: both loops'
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
    needs_grad: bool,
    timer: _Timer,
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
    needs_grad: bool,
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
