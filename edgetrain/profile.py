"""From an ``nn.Sequential`` to a :class:`~edgetrain.chain.Chain`: measured or from shapes alone.

* :func:`profile` runs each stage on this device: memory from what autograd really keeps
  (tensor storages, each counted once) and the transient peaks, time as the median of several runs.
* :func:`analytic_chain` does the same memory accounting on ``meta`` tensors (shapes, no data), so a
  user can plan for a device they do not have; its times are estimates from floating-point
  operation counts at a nominal speed (:data:`NOMINAL_FLOPS`), good for relative costs only.

Both measure memory with :class:`~edgetrain.measure.StorageCounter` and run stages exactly as the
executor does (:mod:`edgetrain.stages`), so a measured chain and its analytic twin agree on every
byte count, and both agree with what :class:`~edgetrain.execute.Checkpointed` then holds.
Profiling leaves the model as it found it: BatchNorm statistics, gradients and the RNG state are
restored afterwards.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from edgetrain.chain import Chain, Stage
from edgetrain.errors import InvalidInput
from edgetrain.measure import StorageCounter, module_bytes, storage_key
from edgetrain.stages import group_children, run_backward, run_forward, run_forward_with_grad

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


def profile(model: nn.Module, sample_input: torch.Tensor, *, repeats: int = 3) -> Chain:
    """Measure ``model`` (an ``nn.Sequential``) on ``sample_input`` on this device.

    Each child is one stage (children that return a view of their input or change it in place are
    merged with a neighbour, see :func:`edgetrain.stages.group_children`). Time is the median of
    ``repeats`` runs of each stage's forward (with grad) and backward.
    """
    return _profile(model, sample_input, timer=_Timer(repeats))


def analytic_chain(
    model: nn.Module, sample_input: torch.Tensor, *, flops_per_second: float = NOMINAL_FLOPS
) -> Chain:
    """The chain of ``model`` from shapes alone, on meta tensors: no data, no timing.

    ``sample_input`` may be a meta tensor (``torch.empty(shape, device="meta")``) or a real one
    (only its shape, dtype and ``requires_grad`` are used). The model is copied to the meta device
    unless it is already there. Stage times are FLOP counts over ``flops_per_second``.
    """
    _check_model(model)
    meta_model = model if _on_meta(model) else copy.deepcopy(model).to("meta")
    x = torch.empty(sample_input.shape, dtype=sample_input.dtype, device="meta")
    x.requires_grad_(sample_input.requires_grad)
    return _profile(meta_model, x, timer=None, flops_per_second=flops_per_second)


def _on_meta(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Sequential):
        raise InvalidInput(
            f"edgetrain plans over the children of an nn.Sequential, got {type(model).__name__}; "
            "wrap the model's blocks in nn.Sequential(...)"
        )
    if len(model) == 0:
        raise InvalidInput("the nn.Sequential has no children; give a model with layers")


class _Timer:
    def __init__(self, repeats: int) -> None:
        if repeats < 1:
            raise InvalidInput(f"repeats must be at least 1, got {repeats}")
        self.repeats = repeats


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Restore buffers, parameter gradients and the RNG state after profiling."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    rng = torch.get_rng_state()
    try:
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    # Backward adds into existing gradients in place, as in a training loop
                    # after its first step; profile in that regime.
                    p.grad = torch.zeros_like(p)
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for p, grad in grads:
            p.grad = grad
        torch.set_rng_state(rng)


def _profile(
    model: nn.Module,
    sample_input: torch.Tensor,
    *,
    timer: _Timer | None,
    flops_per_second: float = NOMINAL_FLOPS,
    flops: bool = True,
) -> Chain:
    _check_model(model)
    assert isinstance(model, nn.Sequential)
    stages: list[Stage] = []
    # On meta tensors a stage's costs follow from its structure and input shape alone, so
    # identical stages (the repeated blocks of a ResNet) are profiled once.
    memo: dict[tuple[str, tuple[int, ...], torch.dtype, bool], tuple[Stage, torch.Tensor]] = {}
    with _preserved(model):
        groups = group_children(model, sample_input)
        x = sample_input.detach()
        for index, (name, module, span) in enumerate(groups):
            needs_grad = index > 0 or sample_input.requires_grad
            key = (repr(module), tuple(x.shape), x.dtype, needs_grad)
            if timer is None and key in memo:
                known, out = memo[key]
                stage, x = known.renamed(name), torch.empty_like(out)
            else:
                stage, x = _profile_stage(
                    name,
                    module,
                    span,
                    x,
                    needs_grad,
                    timer,
                    flops_per_second if flops else 0.0,
                    index,
                )
                if timer is None:
                    memo[key] = (stage, x)
            stages.append(stage)
    return Chain(
        stages=tuple(stages),
        input_bytes=sample_input.numel() * sample_input.element_size(),
        input_requires_grad=sample_input.requires_grad,
        name=type(model).__name__,
    )


def _profile_stage(
    name: str,
    module: nn.Module,
    span: int,
    x: torch.Tensor,
    needs_grad: bool,
    timer: _Timer | None,
    flops_per_second: float,
    index: int,
) -> tuple[Stage, torch.Tensor]:
    counter = StorageCounter()
    layer_outputs = _LayerOutputs(module)
    with counter:
        base = counter.reset_peak()
        with layer_outputs:
            out = run_forward(module, x, stage=index, name=name)
        forward_peak = counter.peak_bytes - base
        output_bytes = counter.live_bytes - base

        saved: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.add(storage_key(t))
            return t

        base = counter.reset_peak()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            leaf, y = run_forward_with_grad(
                module, x, needs_input_grad=needs_grad, stage=index, name=name
            )
        forward_grad_peak = counter.peak_bytes - base
        kept = counter.live_bytes - base
        grad_out = torch.ones_like(y) if y.device.type == "meta" else torch.randn_like(y)
        base = counter.reset_peak()
        run_backward(leaf, y, grad_out)
        backward_peak = counter.peak_bytes - base
    saves_input = storage_key(x) in saved
    del leaf, y, grad_out

    forward_seconds = backward_seconds = 0.0
    if timer is not None:
        forward_seconds, backward_seconds = _time_stage(module, x, needs_grad, timer, index, name)
    elif flops_per_second > 0:
        forward_flops, backward_flops = _count_flops(module, x, needs_grad, index, name)
        elements = out.numel()
        forward_seconds = (forward_flops + elements) / flops_per_second
        backward_seconds = (backward_flops + 2 * elements) / flops_per_second
    params, grads, buffers = module_bytes(module)
    stage = Stage(
        name=name,
        output_bytes=output_bytes,
        saved_bytes=kept - output_bytes,
        saves_input=saves_input,
        forward_peak_bytes=forward_peak,
        forward_grad_peak_bytes=forward_grad_peak,
        backward_peak_bytes=backward_peak,
        weight_bytes=params,
        gradient_bytes=grads,
        forward_seconds=forward_seconds,
        backward_seconds=backward_seconds,
        layer_output_bytes=layer_outputs.bytes,
        buffer_bytes=buffers,
        span=span,
    )
    return stage, out


def _time_stage(
    module: nn.Module, x: torch.Tensor, needs_grad: bool, timer: _Timer, index: int, name: str
) -> tuple[float, float]:
    forward: list[float] = []
    backward: list[float] = []
    for _ in range(timer.repeats):
        start = time.perf_counter()
        leaf, y = run_forward_with_grad(
            module, x, needs_input_grad=needs_grad, stage=index, name=name
        )
        middle = time.perf_counter()
        run_backward(leaf, y, torch.ones_like(y))
        end = time.perf_counter()
        forward.append(middle - start)
        backward.append(end - middle)
        del leaf, y
    return statistics.median(forward), statistics.median(backward)


def _count_flops(
    module: nn.Module, x: torch.Tensor, needs_grad: bool, index: int, name: str
) -> tuple[int, int]:
    counter = FlopCounterMode(display=False)
    with counter:
        leaf, y = run_forward_with_grad(
            module, x, needs_input_grad=needs_grad, stage=index, name=name
        )
    forward = counter.get_total_flops()
    counter = FlopCounterMode(display=False)
    with counter:
        run_backward(leaf, y, torch.ones_like(y))
    return forward, counter.get_total_flops()


class _LayerOutputs:
    """Adds up the output bytes of the layers the paper counts (:data:`LAYER_TYPES`)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.bytes = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, _module: nn.Module, _inputs: object, output: object) -> None:
        if isinstance(output, torch.Tensor):
            self.bytes += output.numel() * output.element_size()

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


def model_chain(name: str, batch: int, image: int, *, timing: bool = True) -> Chain:
    """The analytic chain of a registered model (see :mod:`edgetrain.models`) for a batch of
    ``batch`` square RGB images of side ``image``, built on the meta device (no memory, no data).

    ``timing=False`` skips the FLOP count (stage times are then 0): enough for memory tables.
    """
    from edgetrain.models import build, canonical_name, check_image

    if batch < 1:
        raise InvalidInput(f"batch must be at least 1, got {batch}")
    key = canonical_name(name)
    check_image(key, image, batch)
    with torch.device("meta"):
        model = build(key)
    sample = torch.empty(batch, 3, image, image, device="meta")
    chain = _profile(model, sample, timer=None, flops_per_second=NOMINAL_FLOPS, flops=timing)
    return Chain(chain.stages, chain.input_bytes, chain.input_requires_grad, name=key)
