"""The scratch a stage's kernels take beyond its tensors, measured once per kind of operator call.

A convolution's workspace (``im2col`` columns, a depthwise kernel's buffers), a BatchNorm
backward's temporary of the input's size, an attention kernel's blocks: memory a kernel
allocates for itself and frees before it returns, which no tensor holds and
:class:`~edgetrain.autograd.storage_counter.StorageCounter` therefore does not see, yet the
device holds while the kernel runs.

While a stage is sized (on meta tensors or on the device), :class:`OpScratch` notes each call of
an operator that may take scratch (not an elementwise operator, whose kernel writes its output
in place, nor a view or an in-place one), keyed as :class:`~edgetrain.autograd.meta_memo.MetaMemo`
keys its calls: the operator, its arguments' shapes, strides and dtypes, its other arguments,
and torch's thread count (a kernel may take a buffer per thread). :func:`measure_scratch` then
runs each call not measured before on the CPU, on tensors of those shapes (zeros), in each
of :data:`LAYOUTS` (as noted, contiguous, channels-last), in one torch profiler session with
``profile_memory=True``, whose allocator events record every allocation and free of torch's CPU
allocator in order (oneDNN's scratchpads included): the most the running total rose above what
the call left allocated (its outputs) is the call's scratch. The process remembers it: a kind of
call is measured once (the repeated blocks of a network, a second plan of the same model).

A stage's forward scratch is the most any of its forward calls takes, its backward scratch the
most any call of its backward takes (a call runs in the backward when autograd's engine runs it).
It counts on top of the stage's tensor peak: the tensors live while a call runs, with its
outputs, are at most that peak, so the heap the stage needs is at most the two together.
Measured on the CPU (meta tensors size the CPU's step); a call on another device takes none, and
none is measured while another profiler runs (the profiler does not nest).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from edgetrain.autograd.meta_memo import call_key
from edgetrain.autograd.op_calls import LAYOUTS, made, makes_new_outputs, specs, strides
from edgetrain.autograd.storage_counter import tensors_in

__all__ = ["LAYOUTS", "REPEATS", "OpScratch", "allocator_peak", "measure_scratch", "scratch_of"]

# A call with a tensor laid out otherwise than contiguously is measured in each of LAYOUTS (the
# most counts; a call whose tensors are all contiguous is measured as noted): a kernel's scratch
# depends on its tensors' layout (a 7x7 depthwise convolution's backward on a channels-last
# gradient took 15 MiB where a contiguous one took 1 MiB), and meta tensors may lay out what a
# stage hands the next otherwise than the CPU does (a convolution's output after a permute:
# contiguous on meta, channels-last on the CPU), so a model that mixes layouts may run a call in
# the other one.

REPEATS = 1
"""Runs of each call measured; the most it takes counts. A kernel's first call could set up
what later ones reuse, or a later one pick another algorithm; on the CPU three runs of every
call of a depthwise, a 7x7 and an inverted-residual chain, attention and ResNet-18 took the
same to the byte, so one run is measured."""

_MARK = "edgetrain.scratch."
_known: dict[tuple[Any, ...], int] = {}  # a kind of call -> its scratch in bytes


class OpScratch(TorchDispatchMode):
    """Notes the kinds of operator call a stage's passes run that may take scratch: ``forward``
    and ``backward`` (run by autograd's engine) hold their keys; ``pending`` what
    :func:`measure_scratch` has still to measure."""

    def __init__(self) -> None:
        super().__init__()
        self.forward: set[tuple[Any, ...]] = set()
        self.backward: set[tuple[Any, ...]] = set()
        self.pending: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if makes_new_outputs(func):
            tensors = tensors_in((args, kwargs))
            if tensors and all(t.device.type in ("cpu", "meta") for t in tensors):
                key = (*call_key(func, args, kwargs), torch.get_num_threads())
                in_backward = torch._C._current_graph_task_id() >= 0
                (self.backward if in_backward else self.forward).add(key)
                if key not in _known and key not in self.pending:
                    self.pending[key] = (func, specs(args), specs(kwargs))
        return func(*args, **kwargs)


def scratch_of(keys: set[tuple[Any, ...]]) -> int:
    """The most scratch any of these kinds of call takes (bytes; 0 for one not measured)."""
    return max((_known.get(key, 0) for key in keys), default=0)


def measure_scratch(pending: dict[tuple[Any, ...], tuple[Any, Any, Any]]) -> None:
    """Measure the calls ``pending`` (see the module) in one profiler session, and remember
    each one's scratch; none while another profiler runs (they stay unmeasured)."""
    todo = [(key, call) for key, call in pending.items() if key not in _known]
    if not todo:
        return
    with _disable_current_modes(), torch.random.fork_rng(devices=[]):
        peaks = _run_marked(todo)
    if peaks is None:
        return
    for i, (key, _) in enumerate(todo):
        runs = range(REPEATS * len(LAYOUTS))
        _known[key] = max((peaks.get((i, r), 0) for r in runs), default=0)


def _run_marked(
    todo: list[tuple[tuple[Any, ...], tuple[Any, Any, Any]]],
) -> dict[tuple[int, int], int] | None:
    """Each call of ``todo`` run :data:`REPEATS` times on new tensors, each run inside a marker
    of the profiler; per ``(call, run)`` the allocator's peak above what the run left held."""

    def run_all() -> None:
        for i, (_, (func, args, kwargs)) in enumerate(todo):
            seen: set[tuple[Any, ...]] = set()
            # Only a call that already mixes layouts is measured in the others.
            mixed = strides((args, kwargs), "as noted") != strides((args, kwargs), "contiguous")
            for r in range(REPEATS * len(LAYOUTS)):
                layout = LAYOUTS[r % len(LAYOUTS)]
                laid = strides((args, kwargs), layout)
                if (r < len(LAYOUTS) and laid in seen) or (layout != "as noted" and not mixed):
                    continue  # laid out as a layout measured already
                seen.add(laid)
                made_args, made_kwargs = made(args, layout), made(kwargs, layout)
                try:
                    with record_function(f"{_MARK}{i}.{r}"):
                        out = func(*made_args, **made_kwargs)
                # A layout or zeros the call does not take: that run counts none.
                except (RuntimeError, ValueError, TypeError, IndexError):
                    continue
                del out, made_args, made_kwargs

    events = _allocator_events(run_all)
    if events is None:
        return None
    marks, memory = events
    peaks: dict[tuple[int, int], int] = {}
    total, j = 0, 0
    for name, start, end in sorted(marks, key=lambda m: m[1]):
        while j < len(memory) and memory[j][0] < start:
            total += memory[j][1]
            j += 1
        peak = total
        while j < len(memory) and memory[j][0] <= end:
            total += memory[j][1]
            peak = max(peak, total)
            j += 1
        call, run = name[len(_MARK) :].split(".")
        peaks[int(call), int(run)] = peak - total
    return peaks


def _allocator_events(
    call: Callable[[], Any],
) -> tuple[list[tuple[str, int, int]], list[tuple[int, int]]] | None:
    """``call()`` under the profiler: its markers ``(name, start, end)`` and the allocator's
    events ``(time, bytes)`` (negative: freed), in nanoseconds; None while another profiler
    runs (``call()`` then runs all the same)."""
    # Kineto logs each start and stop of a profiler on stderr at its default level.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        recorder = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        recorder.__enter__()
    except RuntimeError:
        call()
        return None
    try:
        call()
    finally:
        recorder.__exit__(None, None, None)
    try:
        events = recorder.profiler.kineto_results.events()  # type: ignore[union-attr]
    except AttributeError:
        return None
    marks = [(e.name(), e.start_ns(), e.end_ns()) for e in events if e.name().startswith(_MARK)]
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    return marks, memory


def allocator_peak(call: Callable[[], Any]) -> tuple[int | None, Any]:
    """The peak of torch's CPU allocator's running total during ``call()`` (bytes above its
    start, every allocation and free in order from the profiler's record) and ``call()``'s
    result; None for the peak, ``call()`` run all the same, while another profiler runs."""
    result: list[Any] = []
    events = _allocator_events(lambda: result.append(call()))
    if events is None:
        return None, result[0] if result else None
    total = peak = 0
    for _, nbytes in events[1]:
        total += nbytes
        peak = max(peak, total)
    return peak, result[0]
