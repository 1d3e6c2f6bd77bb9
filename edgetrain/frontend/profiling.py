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
tensor byte count, and both agree with what :class:`~edgetrain.runtime.checkpointed.Checkpointed`
then holds. A measured chain also carries each stage's kernel scratch, from the allocator's
record (:mod:`edgetrain.autograd.scratch`); a chain from shapes has none.
Profiling leaves the model as it found it: BatchNorm statistics, gradients and the RNG state are
restored afterwards.
"""

from __future__ import annotations

import copy
import itertools
import operator
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from edgetrain import progress
from edgetrain.autograd.meta_kernels import cpu_kernels
from edgetrain.autograd.meta_memo import MetaMemo
from edgetrain.autograd.replay import AutocastState, autocast_label, autocasting
from edgetrain.core.chain import Chain, Stage
from edgetrain.errors import InvalidInput
from edgetrain.frontend.chain_profile import NOMINAL_FLOPS, StageMemo, profile_stages
from edgetrain.frontend.cuts import as_stages, on_stage_input, stage_input
from edgetrain.frontend.device_speed import device_speed
from edgetrain.frontend.meta_copies import any_meta, meta_copy, on_meta, to_meta
from edgetrain.frontend.stage_measure import Timer
from edgetrain.frontend.step_peaks import graph_step_peaks, plain_step_peaks, with_module_step

__all__ = [
    "NOMINAL_FLOPS",
    "StageMemo",
    "analytic_chain",
    "graph_step_peaks",
    "merged_chain",
    "plain_step_peaks",
    "profile_chain",
    "with_module_step",
]


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
    merged with a neighbour, see :func:`edgetrain.autograd.stage_grouping.group_children`). Time is
    the least process CPU time (seconds) of ``repeats`` runs of each stage's forward (with grad) and
    backward (see :class:`Timer`). ``autocast``: the ``torch.autocast`` state the steps run
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
        chain = profile_stages(model, sample_input, timer=Timer(repeats), scratch=True)
        return chain if _sized_alike_on_meta(chain, model, sample_input) else _unsized(chain)
    with autocasting(autocast):
        chain = profile_stages(
            model, sample_input, timer=Timer(repeats), plain_step=False, scratch=True
        )
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
        twin = meta_copy(model)
        with cpu_kernels() as unlike_cpu, MetaMemo():
            chain = profile_stages(
                twin, to_meta(sample_input), timer=None, speed=speed, scratch=True
            )
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
    if chain.autograd_peak_bytes is None or any_meta(sample_input):
        return True
    try:
        twin = meta_copy(model)
    except (TypeError, RuntimeError, copy.Error):
        return False
    try:
        with cpu_kernels() as unlike_cpu, MetaMemo():
            sized = profile_stages(
                twin, to_meta(sample_input), timer=None, flops=False, plain_step=False
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
    if on_meta(model) or any_meta(sample_input):
        model = model if on_meta(model) else meta_copy(model)
        sample_input = to_meta(sample_input)
    stages = as_stages(model, sample_input)
    sample_input = stage_input(stages, sample_input)  # keyword inputs as the stages take them
    meta_model = stages if on_meta(stages) else meta_copy(stages)
    with cpu_kernels() as unlike_cpu, MetaMemo():
        chain = profile_stages(
            meta_model,
            to_meta(sample_input),
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
    chain: Chain,
    modules: list[nn.Module],
    first: list[int],
    sample_input: Any,
    memo: StageMemo | None = None,
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
    sized unlike the CPU) on the sample's own device, as the executor will run them. ``memo``:
    stages sized on meta tensors by earlier calls for the same chain and sample (the stages
    no run merges are sized once, not once per call; see :class:`StageMemo`)."""
    bounds = [*first, chain.length]
    # Its own stages only: the chain's plain step does not apply to it (set to None below).
    # Its kernels' scratch as the chain has it: measured, or none (a chain from shapes).
    scratch = any(s.forward_scratch_bytes or s.backward_scratch_bytes for s in chain.stages)
    sized = _sized_on_meta(nn.Sequential(*modules), sample_input, scratch=scratch, memo=memo)
    if sized is None:
        sized = profile_stages(
            nn.Sequential(*modules),
            sample_input,
            timer=None,
            flops=False,
            plain_step=False,
            scratch=scratch,
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


def _sized_on_meta(
    model: nn.Module, sample_input: Any, *, scratch: bool, memo: StageMemo | None = None
) -> Chain | None:
    """``model``'s stages sized (not timed) on meta tensors; None where meta tensors would not
    size them as the sample's device runs them (see :func:`merged_chain`)."""
    if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        return None
    try:
        twin = meta_copy(model, None if memo is None else memo.copies)
        with cpu_kernels() as unlike_cpu, MetaMemo():
            sized = profile_stages(
                twin,
                to_meta(sample_input),
                timer=None,
                flops=False,
                plain_step=False,
                scratch=scratch,
                memo=memo,
            )
    except (TypeError, NotImplementedError, RuntimeError, InvalidInput, copy.Error):
        return None
    return None if unlike_cpu else sized


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
