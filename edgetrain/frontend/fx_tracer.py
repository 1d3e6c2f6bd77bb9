"""The tracer :func:`~edgetrain.frontend.fx_capture.capture` traces a model with.

Why ``torch.fx`` and not ``torch.export`` or dispatch-level tracing: fx keeps the model's own
leaf modules (``Conv2d``, ``BatchNorm2d``, ``Dropout``) and in-place operations exactly as
written, so a cut graph re-runs *the same modules*: BatchNorm updates its own running
statistics, dropout draws from the same RNG stream in the same order, tied weights stay one
parameter. ``torch.export`` (and AOT/dispatch tracing) lowers to ATen operators, functionalises
in-place updates and turns BatchNorm's buffer updates into graph outputs, which an executor
would have to write back; it also takes seconds per model. Meta values cost little (norms,
activations and dropout are sized without a kernel): tracing ResNet-152 costs a small part of
the one run on the sample that follows. The price: Python control flow that depends
on a tensor's *value* cannot be traced (nor can torch.export trace it without rewriting);
:func:`~edgetrain.frontend.fx_capture.capture` then raises one
:class:`~edgetrain.errors.InvalidInput` line naming the
construct, where it is, and what to do (``leaf_modules=(TheModule,)`` among the fixes).
The tracer is fx's own, except that ``a += b`` on a tensor is recorded as ``operator.iadd``
(in place, as eager runs it) where plain fx would record ``a = a + b``.
fx bakes Python values in at trace time (``self.training`` passed to ``F.dropout``, for
example): capture the model in the mode it will run in.

A ``forward()`` that assigns to a module attribute (``self.aux_loss = ...``,
``self.steps += 1``) cannot be captured (the captured step would never
assign it) and is refused, the attribute left as it was.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from edgetrain import progress
from edgetrain.errors import InvalidInput
from edgetrain.frontend.concrete import ValueTracer
from edgetrain.frontend.containers import is_container, kept_whole_reason, traced_forward

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_CONCRETE = str(Path(__file__).resolve().parent / "concrete.py")


class Tracer(ValueTracer):
    """``torch.fx.symbolic_trace``'s tracer, keeping augmented assignments in place and noting
    on each node the grad mode and autocast region it was traced in (see :func:`_context`).

    fx hands a traced ``forward()`` the module's buffers themselves, not proxies, so a forward
    that updates a buffer in place (``self.num_batches_tracked.add_(1)`` in a BatchNorm subclass)
    updates it once while tracing and never in the graph. The tracer notes each module whose own
    forward did so (:attr:`updaters`, by path, the innermost module called); ``leaves`` are kept
    as single calls, which run their forward, updates included, at every step."""

    def __init__(self, given: _Given, leaves: frozenset[int] = frozenset()) -> None:
        super().__init__(*given)
        self.leaves = leaves  # ids of the modules kept whole
        self.updaters: dict[str, nn.Module] = {}
        self.kept_whole: dict[str, str] = {}  # container path -> why it stays one call
        self._into: set[int] = set()  # ids of the containers traced into
        self._updated: set[int] = set()  # ids of the buffers a noted module updated

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) in self._into:
            return False
        return id(m) in self.leaves or super().is_leaf_module(m, module_qualified_name)

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if is_container(m) and id(m) not in self.leaves:
            reason = kept_whole_reason(m, args, kwargs)
            if reason:
                self.kept_whole[self.path_of_module(m)] = reason
            else:  # traced into: its layers become nodes, cut between like any others
                self._into.add(id(m))
                forward = traced_forward(m)
        versions = [(b, b._version) for b in m.buffers()]
        result = super().call_module(m, forward, args, kwargs)
        updated = {id(b) for b, seen in versions if b._version != seen} - self._updated
        if updated:
            self.updaters[self.path_of_module(m)] = m
            self._updated |= updated
        return result

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        # a value computed is no part of the trace: no autocast region, no attribute read
        regions, _TRACING.regions = getattr(_TRACING, "regions", None), None
        try:
            with super().computing():
                yield
        finally:
            _TRACING.regions = regions

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta[CONTEXT] = _context()
        return node


CONTEXT = "edgetrain_context"
Context = tuple[bool, tuple[str, torch.dtype, bool] | None]
"""Where a node runs: grad mode on (True) or off, and the innermost ``torch.autocast`` region
``forward()`` entered around it (device type, dtype, enabled), or None."""
_PLAIN = (bool, int, float, str, type(None))
_MODULE_OWN = frozenset(vars(nn.Module()))  # ``training`` and torch's own bookkeeping
_TRACE_LOCK = threading.Lock()  # one trace at a time: the patches below (and the mask
# builder fx_capture swaps in, see mask_broadcast) are global
_TRACING = threading.local()  # in the tracing thread: its autocast regions and attribute reads


def _context() -> Context | None:
    """The current node's :data:`Context`, or None for the default (grad on, no region)."""
    grad = torch.is_grad_enabled()
    regions = getattr(_TRACING, "regions", None)
    region = regions[-1][1] if regions else None
    return None if grad and region is None else (grad, region)


@contextlib.contextmanager
def noting_contexts() -> Iterator[dict[tuple[nn.Module, str], None]]:
    """While tracing in this thread, note the ``torch.autocast`` regions ``forward()`` enters
    (fx sees only calls; the grad mode is read as it is, the trace running with grad on) and the
    plain attributes it reads (yielded, in order). Other threads run as usual meanwhile."""
    cls = torch.amp.autocast_mode.autocast
    reads: dict[tuple[nn.Module, str], None] = {}
    with _TRACE_LOCK:
        enter, leave = cls.__enter__, cls.__exit__

        def entering(self: Any) -> Any:
            result = enter(self)
            regions = getattr(_TRACING, "regions", None)
            if regions is not None:
                regions.append((id(self), (self.device, self.fast_dtype, bool(self._enabled))))
            return result

        def leaving(self: Any, *exc: Any) -> Any:
            regions = getattr(_TRACING, "regions", None)
            if regions and regions[-1][0] == id(self):
                regions.pop()
            return leave(self, *exc)

        def reading(self: nn.Module, name: str) -> Any:
            value = object.__getattribute__(self, name)
            if (
                type(value) in _PLAIN
                and name not in _MODULE_OWN
                and getattr(_TRACING, "regions", None) is not None
                and name in object.__getattribute__(self, "__dict__")
            ):
                reads[(self, name)] = None
            return value

        cls.__enter__, cls.__exit__ = entering, leaving  # type: ignore[method-assign]
        nn.Module.__getattribute__ = reading  # type: ignore[method-assign]
        _TRACING.regions = []
        try:
            yield reads
        finally:
            del _TRACING.regions
            del nn.Module.__getattribute__
            cls.__enter__, cls.__exit__ = enter, leave  # type: ignore[method-assign]


def trace_keeping_updaters_whole(
    model: nn.Module, given: _Given, buffers: _Saved
) -> tuple[fx.Graph, dict[str, str], dict[str, torch.Tensor]]:
    """Trace ``model``; when a submodule's forward updates its buffers in place (fx runs it on
    the real buffers), trace again with each such submodule kept as one call, so that the
    captured step runs its update as plain autograd does. InvalidInput when ``model``'s own
    forward updates a buffer in place (it cannot be kept whole)."""
    versions = [b._version for b, _, _ in buffers]
    tracer = Tracer(given)
    graph = tracer.run(model)
    if tracer.updaters:
        put_back(buffers)
        versions = [b._version for b, _, _ in buffers]
        tracer = Tracer(given, frozenset(id(m) for m in tracer.updaters.values()))
        graph = tracer.run(model)
    names = {id(b): n for n, b in model.named_buffers()}
    changed = [
        names[id(b)]
        for (b, _, _), seen in zip(buffers, versions, strict=True)
        if b._version != seen
    ]
    if changed:
        raise InvalidInput(
            f"cannot capture {type(model).__name__}: its forward() updates the buffer "
            f"{changed[0]!r} in place itself (torch.fx would run that update once, while "
            "tracing); update it in a submodule's forward() or outside the model"
        )
    for path, reason in tracer.kept_whole.items():
        progress.note(f"{path or type(model).__name__} is one stage: {reason}")
    own = vars(model)
    names = [n for n in tracer.tensor_attrs.values() if n.startswith(CONSTANT_PREFIX)]
    constants = {n: _unexpanded(own.pop(n)) for n in names}
    return graph, tracer.kept_whole, constants


def _unexpanded(tensor: torch.Tensor) -> torch.Tensor:
    """A constant as the graph module holds it (a buffer): an expanded one (``t.expand(B, T)``,
    several elements in one place) as a copy, so it can be copied into."""
    expanded = any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.shape, strict=True))
    return tensor.clone() if expanded else tensor


CONSTANT_PREFIX = "_tensor_constant"  # fx's name for a tensor the trace made (torch.arange(T))


def traced_module(
    model: nn.Module, graph: fx.Graph, constants: dict[str, torch.Tensor]
) -> fx.GraphModule:
    """``graph`` as a module over ``model``'s modules, holding the constant tensors the trace
    made (which are no part of ``model``)."""
    own = vars(model)
    own.update(constants)
    try:
        return fx.GraphModule(model, graph)
    finally:
        for name in constants:
            own.pop(name, None)


_Given = tuple[dict[str, torch.Tensor], bool, tuple[type[nn.Module], ...]]
"""The sample's inputs by name, whether passed by keyword, and the leaf module classes."""
_Saved = list[tuple[torch.Tensor, torch.Tensor, int]]
"""Each buffer, a copy of its value and its version counter, before tracing."""


def put_back(buffers: _Saved) -> None:
    """Copy each buffer's saved value back into it if tracing updated it in place."""
    with torch.no_grad():
        for buffer, value, version in buffers:
            if buffer._version != version:
                buffer.copy_(value)


def trace_error(model: nn.Module, exc: Exception) -> str:
    """One line: what fx could not trace, where in the user's code, and what to do."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where, holder = "", None
    tb = exc.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame, summary in zip(
        reversed(frames), reversed(traceback.extract_tb(exc.__traceback__)), strict=True
    ):
        path = str(Path(summary.filename).resolve())
        if not path.startswith(_TORCH_DIR) and path != _CONCRETE:
            code = (summary.line or "").strip()
            where = f" at {Path(summary.filename).name}:{summary.lineno}" + (
                f" `{code}`" if code else ""
            )
            owner = frame.f_locals.get("self")
            holder = type(owner).__name__ if isinstance(owner, nn.Module) else None
            break
    leaf = (
        f"keep {holder} untraced with leaf_modules=({holder},)"
        if holder and holder != type(model).__name__
        else "move that code into a submodule and keep it untraced with leaf_modules=(...)"
    )
    if "iterated" in text:
        construct = "a loop over a tensor (or a tensor passed as *args)"
        fix = "loop over range(n) with n known when the model is built, or use tensor operations"
    elif "control flow" in text:
        construct = "a Python if/while on a tensor's value"
        fix = (
            "compute both branches and pick with torch.where, decide on a Python attribute "
            f"or argument instead, or {leaf}"
        )
    else:
        construct = f"{type(exc).__name__}: {text}"
        fix = f"make forward() traceable by torch.fx (no Python logic on tensor values), or {leaf}"
    return f"cannot capture {type(model).__name__}: {construct}{where}; {fix}"
