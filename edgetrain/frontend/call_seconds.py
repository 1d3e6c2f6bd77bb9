"""The time of an operator call the device model cannot predict, measured once per kind of call.

:class:`~edgetrain.frontend.device_speed.DeviceSpeed` predicts a call from its FLOPs (matrix
products, convolutions, attention) or from the bytes it moves (elementwise operators). Other
operators do more per byte than an addition, and by how much depends on the operator: on one
thread here, a training BatchNorm's forward over a batch of 8 × 96 × 48² took 8.8 ms where an
addition moving as many bytes predicts 0.24 ms; a 3×3 max pooling of stride 2 and its backward
took 25 times the prediction, dropout 16 times, nearest upsampling 9 times. A plan that
recomputes such a stage believes it nearly free.

So a call of an operator with no FLOP formula that is not elementwise, not a view and returns no
input (:func:`timed`) is run on the CPU on zeros of its arguments' shapes, strides and dtypes
(:func:`~edgetrain.autograd.op_calls.made`), outside every dispatch mode, autograd and the
random-number stream (its state is restored), and its least process CPU time over
:data:`REPEATS` runs after one warm-up is its time. A kind of call (the operator, its
arguments' shapes, strides and dtypes, its other arguments and torch's thread count, as
:func:`~edgetrain.autograd.meta_memo.call_key` keys it) is measured once per process: the
repeated blocks of a network and a second plan cost nothing more. A call whose tensors are not
all on the CPU or meta, or that together hold more than :data:`LARGEST_BYTES`, is not run (the
model predicts it).
"""

from __future__ import annotations

import time
from functools import cache
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.flop_counter import flop_registry

from edgetrain.autograd.meta_memo import call_key
from edgetrain.autograd.op_calls import made, makes_new_outputs, specs
from edgetrain.autograd.storage_counter import tensors_in

__all__ = ["LARGEST_BYTES", "REPEATS", "call_seconds", "timed"]

REPEATS = 3
"""Timed runs of each kind of call after a warm-up; the least counts (interference only adds)."""
LARGEST_BYTES = 1 << 30
"""A call whose tensors hold more than this (1 GiB) is predicted, not run."""

_known: dict[tuple[Any, ...], float | None] = {}  # a kind of call -> its seconds (None: failed)


@cache
def timed(func: Any) -> bool:
    """Whether calls of ``func`` are measured: an operator with no FLOP formula that is not
    elementwise, not a view and returns none of its inputs (in place, ``out=``)."""
    if not isinstance(func, torch._ops.OpOverload):
        return False
    if func._overloadpacket in flop_registry or func.is_view:
        return False
    if torch.Tag.nondeterministic_seeded in func.tags:
        return func._overloadpacket in _SEEDED  # dropout's masks: timed, RNG restored
    return makes_new_outputs(func)


_SEEDED = {torch.ops.aten.native_dropout, torch.ops.aten.bernoulli}


def call_seconds(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    """The measured seconds of this kind of call (see the module); None for one not measured
    (not :func:`timed`, on another device, too large, or one its zeros do not suit)."""
    if not timed(func):
        return None
    tensors = tensors_in((args, kwargs))
    if not tensors or any(t.device.type not in ("cpu", "meta") for t in tensors):
        return None
    if sum(t.numel() * t.element_size() for t in tensors) > LARGEST_BYTES:
        return None
    key = (*call_key(func, args, kwargs), torch.get_num_threads())
    if key not in _known:
        _known[key] = _measure(func, specs(args), specs(kwargs))
    return _known[key]


def _measure(func: Any, args: Any, kwargs: Any) -> float | None:
    with _disable_current_modes(), torch.no_grad(), torch.random.fork_rng(devices=[]):
        made_args, made_kwargs = made(args, "as noted"), made(kwargs, "as noted")
        try:
            func(*made_args, **made_kwargs)  # warm-up: a kernel's first call may set up
            least = float("inf")
            for _ in range(REPEATS):
                start = time.process_time()
                func(*made_args, **made_kwargs)
                least = min(least, time.process_time() - start)
        except (RuntimeError, ValueError, TypeError, IndexError):
            return None  # zeros or this layout the call does not take: predicted instead
    return least
