"""How fast this machine runs an operator, measured once: stage times without timing stages.

Measuring every stage of a model (several timed runs of each forward and backward) takes minutes
on a large model. :class:`DeviceSpeed` predicts an operator's seconds from what it does instead:
its floating-point operations (``torch.utils.flop_counter``'s formulas: matrix products,
convolutions, attention) for a matrix product or a convolution of as many operations timed on
this machine, else the bytes it reads and writes for an elementwise operator moving as many, and
a fixed cost per operator call (dispatch and autograd's bookkeeping). The rate grows with the
size of the work (a 3×3 convolution of 0.3 MFLOP ran at 7 GFLOP/s here, one of 1.2 GFLOP at 107:
a call's fixed cost, then threads and vector units filling up), so each kind is timed at four or
five sizes, from calls of a few microseconds, and an operator's seconds are interpolated between
them on log scales (beyond them, at the nearest size's rate). Convolutions are timed dense and
depthwise, forward and backward apart, against their work as the FLOP counter counts it.
:func:`device_speed` times them once per machine, torch version and thread count (a second or
two) and keeps them in the cache directory (:mod:`edgetrain.cache`; a file for each,
:func:`cache_path`), written atomically with a checksum that is verified when read: a damaged or
foreign file is measured again. ``$EDGETRAIN_DEVICE_SPEED`` (a JSON object of
:class:`DeviceSpeed`'s fields) sets them instead. Calls the timed operators do not predict (a
BatchNorm, a pooling, dropout) are timed themselves, once per kind of call
(:mod:`edgetrain.frontend.call_seconds`), unless a speed given that way leaves out
``"times_calls": true``.

:class:`OpSeconds` (a ``TorchDispatchMode``) adds up the predicted seconds of the operators run
inside it; it works on meta tensors, so a stage is timed from shapes alone.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from edgetrain import progress
from edgetrain.autograd.storage_counter import tensors_in
from edgetrain.cache import machine, measured_path, measured_text, read_measured
from edgetrain.core.schedule import atomic_write_text
from edgetrain.frontend.call_seconds import call_seconds

CACHE_FILE = "device_speed.json"
"""The cache file's name pattern: ``device_speed-<machine hash>.json``, one per machine, torch
version and thread count (see :func:`cache_path`), so processes run with other thread counts
keep their own."""
ENV = "EDGETRAIN_DEVICE_SPEED"

_aten = torch.ops.aten
_CONVOLUTIONS = {
    _aten.convolution,
    _aten._convolution,
    _aten.cudnn_convolution,
}


SIDES = (32, 128, 256, 512, 1024)
"""The matrix products timed: ``n × n`` by ``n × n``, from a few microseconds (where a call's
fixed cost is most of it) to where the vector units are full."""
CONVOLUTIONS = ((8, 8), (16, 16), (32, 16), (64, 32), (128, 32))
"""The convolutions timed (3×3, batch 4), dense and depthwise: ``(channels in = out, side)``. A
small one runs at a tenth of a large one's rate per FLOP (a 4 × 8 × 8² input: 44 µs for
0.3 MFLOP here), and a depthwise one far below a dense one's."""
NUMELS = (1 << 10, 1 << 14, 1 << 18, 1 << 22)
"""The elementwise additions timed: elements of each float32 operand."""

Points = tuple[tuple[float, float], ...]
"""(work, process CPU seconds) at increasing work: what :func:`measure_speed` timed."""


def _interpolated(points: Points, work: float) -> float:
    """Seconds for ``work`` on the log-log line through ``points``; beyond them, at the rate
    of the nearest point."""
    if work <= 0:
        return 0.0
    if work <= points[0][0]:
        return points[0][1] * work / points[0][0]
    for (w0, s0), (w1, s1) in itertools.pairwise(points):
        if work <= w1:
            f = math.log(work / w0) / math.log(w1 / w0)
            return math.exp(math.log(s0) + f * math.log(s1 / s0))
    return points[-1][1] * work / points[-1][0]


@dataclass(frozen=True)
class DeviceSpeed:
    """This machine's timed operators (process CPU seconds, at its torch thread count)."""

    matmul_flops: Points  # matrix products (and attention): FLOPs, seconds
    conv_flops: Points  # convolutions' forward: FLOPs, seconds
    elementwise_bytes: Points  # an addition: bytes read plus written, seconds
    seconds_per_op: float  # an operator call's own cost, with autograd recording it
    conv_backward_flops: Points | None = None  # their backward (both gradients); None: as forward
    depthwise_flops: Points | None = None  # grouped convolutions' forward; None: as dense
    depthwise_backward_flops: Points | None = None  # their backward; None: as dense
    times_calls: bool = False  # the calls no FLOP formula or byte count predicts are timed

    def op_seconds(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> float:
        """Predicted seconds of one call of ``func`` that returned ``out``: with
        ``times_calls``, a call no FLOP formula or byte count predicts (a BatchNorm, a pooling)
        at its time measured on this machine (:mod:`edgetrain.frontend.call_seconds`; at least
        ``seconds_per_op``), else from the timed operators."""
        if self.times_calls:
            measured = call_seconds(func, args, kwargs)
            if measured is not None:
                return max(measured, self.seconds_per_op)
        packet = func._overloadpacket
        count = flop_registry.get(packet)
        if count is not None:
            flops = float(count(*args, **kwargs, out_val=out))
            if packet is _aten.convolution_backward:
                points = self._convolution(args[9] if len(args) > 9 else 1, backward=True)
            elif packet in _CONVOLUTIONS:
                points = self._convolution(args[8] if len(args) > 8 else 1, backward=False)
            else:
                points = self.matmul_flops
            return self.seconds_per_op + _interpolated(points, flops)
        if func.is_view:
            return self.seconds_per_op
        moved = sum(t.numel() * t.element_size() for t in tensors_in((args, kwargs, out)))
        return self.seconds_per_op + _interpolated(self.elementwise_bytes, moved)

    def _convolution(self, groups: Any, *, backward: bool) -> Points:
        """The timings for a convolution of ``groups`` groups (grouped and depthwise ones run
        far below a dense one's rate per FLOP), forward or ``backward``."""
        dense = (self.conv_backward_flops if backward else None) or self.conv_flops
        if not isinstance(groups, int) or groups <= 1:
            return dense
        grouped = self.depthwise_backward_flops if backward else self.depthwise_flops
        return grouped or dense

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceSpeed:
        """The speed in ``data`` (as :func:`dataclasses.asdict` gives it), checked: every number
        positive and finite, the work of each kind increasing; else ValueError."""

        def points(value: Any) -> Points:
            pairs = tuple((float(w), float(t)) for w, t in value)
            numbers = [v for pair in pairs for v in pair]
            works = [w for w, _ in pairs]
            if not pairs or not all(math.isfinite(v) and v > 0 for v in numbers):
                raise ValueError(f"not positive numbers: {value!r}")
            if works != sorted(set(works)):
                raise ValueError(f"work not increasing: {value!r}")
            return pairs

        per_op = float(data["seconds_per_op"])
        if not math.isfinite(per_op) or per_op <= 0:
            raise ValueError(f"seconds_per_op must be a positive number, got {per_op!r}")
        optional = {
            key: None if data.get(key) is None else points(data[key])
            for key in ("conv_backward_flops", "depthwise_flops", "depthwise_backward_flops")
        }
        return cls(
            points(data["matmul_flops"]),
            points(data["conv_flops"]),
            points(data["elementwise_bytes"]),
            per_op,
            **optional,
            times_calls=bool(data.get("times_calls", False)),
        )


class OpSeconds(TorchDispatchMode):
    """Adds up, in :attr:`seconds`, the predicted time of every operator run inside it."""

    def __init__(self, speed: DeviceSpeed) -> None:
        super().__init__()
        self.speed = speed
        self.seconds = 0.0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.seconds += self.speed.op_seconds(func, args, kwargs, out)
        return out


def _least_seconds(run: Callable[[], object], repeats: int = 7) -> float:
    """Least process CPU time of ``repeats`` runs (interference only adds time)."""
    run()
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        samples.append(time.process_time() - start)
    return max(min(samples), 1e-9)


def _timed(work: float, run: Callable[[], object]) -> tuple[float, float]:
    return float(work), _least_seconds(run)


def _monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``points`` with no smaller work taking longer than a larger one: on a loaded machine a
    small operator's least time can still be inflated (a 256³ product read 16 ms, a 512³ one
    6 ms), never deflated."""
    out = list(points)
    for i in reversed(range(len(out) - 1)):
        out[i] = (out[i][0], min(out[i][1], out[i + 1][1]))
    return out


def _counted_flops(run: Callable[[], object]) -> float:
    """The FLOPs ``torch.utils.flop_counter`` counts for ``run()``: the work
    :meth:`DeviceSpeed.op_seconds` reads for the same operators (its count of a grouped
    convolution's backward is not twice the forward's)."""
    with FlopCounterMode(display=False) as counter:
        run()
    return float(counter.get_total_flops())


def _convolutions(groups: bool) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(forward, backward) timings of 3×3 convolutions of :data:`CONVOLUTIONS`' sizes, batch 4:
    dense, or depthwise (``groups``: one group per channel); the backward computes both
    gradients (input and weight). Each is timed against its work as
    ``torch.utils.flop_counter`` counts it."""
    gen = torch.Generator().manual_seed(0)
    forward, backward = [], []
    for channels, side in CONVOLUTIONS:
        group = channels if groups else 1
        x = torch.randn(4, channels, side, side, generator=gen, requires_grad=True)
        w = torch.randn(channels, channels // group, 3, 3, generator=gen, requires_grad=True)
        out = torch.conv2d(x, w, padding=1, groups=group)
        grad = torch.ones_like(out)

        def back(out=out, x=x, w=w, grad=grad) -> object:  # type: ignore[no-untyped-def]
            return torch.autograd.grad(out, (x, w), grad, retain_graph=True)

        def ahead(x=x, w=w, group=group) -> object:  # type: ignore[no-untyped-def]
            with torch.no_grad():
                return torch.conv2d(x, w, padding=1, groups=group)

        backward.append((_counted_flops(back), _least_seconds(back)))
        forward.append((_counted_flops(ahead), _least_seconds(ahead)))
    return _monotone(forward), _monotone(backward)


def measure_speed() -> DeviceSpeed:
    """Time a few operators of several sizes each on the CPU (see the module)."""
    gen = torch.Generator().manual_seed(0)
    matmul, elementwise = [], []
    conv, conv_backward = _convolutions(groups=False)
    depthwise, depthwise_backward = _convolutions(groups=True)
    with torch.no_grad():
        for n in SIDES:
            a = torch.randn(n, n, generator=gen)
            matmul.append(_timed(2 * n**3, lambda a=a: a @ a))
        for numel in NUMELS:
            big = torch.randn(numel, generator=gen)
            elementwise.append(_timed(3 * numel * 4, lambda big=big: big + big))
    tiny = torch.ones(1, requires_grad=True)

    def calls() -> None:
        for _ in range(200):
            tiny * 2.0

    per_op = _least_seconds(calls) / 200
    return DeviceSpeed.from_dict(
        {
            "matmul_flops": _monotone(matmul),
            "conv_flops": conv,
            "elementwise_bytes": _monotone(elementwise),
            "seconds_per_op": per_op,
            "conv_backward_flops": conv_backward,
            "depthwise_flops": depthwise,
            "depthwise_backward_flops": depthwise_backward,
            "times_calls": True,
        }
    )


def _machine() -> str:
    return machine(
        f"torch {torch.__version__}",
        f"threads {torch.get_num_threads()}",
        f"sizes {len(SIDES)}.{len(CONVOLUTIONS)}.{len(NUMELS)}",
        "convolutions 3",
        "calls timed",
    )


def _read(path: os.PathLike[str] | str) -> DeviceSpeed | None:
    """The cached rates for this machine, or None (missing, another machine, damaged)."""
    values = read_measured(path, _machine())
    try:
        return None if values is None else DeviceSpeed.from_dict(values)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


_memo: dict[str, DeviceSpeed] = {}


def cache_path(key: str | None = None) -> Path:
    """Where the rates of machine ``key`` (default: this one, :func:`_machine`) are kept."""
    return measured_path(CACHE_FILE, key or _machine())


def device_speed() -> DeviceSpeed:
    """This machine's rates: ``$EDGETRAIN_DEVICE_SPEED``, else the cached measurement, else
    measured now (once per machine, torch version and thread count) and cached."""
    given = os.environ.get(ENV)
    if given is not None:
        return DeviceSpeed.from_dict(json.loads(given))
    key = _machine()
    if key in _memo:
        return _memo[key]
    path = cache_path(key)
    speed = _read(path)
    if speed is None:
        with progress.task("measuring this machine's speed (matrix products, convolutions)"):
            speed = measure_speed()
        with contextlib.suppress(OSError):  # unwritable: measured again by the next process
            atomic_write_text(path, measured_text(key, asdict(speed)))
    _memo[key] = speed
    return speed
