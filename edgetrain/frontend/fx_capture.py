"""Capture any ``nn.Module`` as a graph of operations, and cut that graph into runnable segments.

:func:`capture` traces ``model`` with torch.fx at the sample's shapes
(:mod:`edgetrain.frontend.concrete`: each proxy carries a meta tensor, so shape queries are
Python ints, branches on shapes are taken once, and a shape never lives across a cut) and runs
the traced graph once on a sample to record, per node (in the graph's order, which is
topological and is the order ``forward()`` runs them): what it is (a leaf-module call, a
function, a tensor method), which values it reads, its output's shape, dtype and bytes, whether
it overwrites a value in place and whether its output shares storage with (is a view of, or the
in-place result of) a value it read. The sample is a tensor, a sequence of positional tensors,
or a mapping of ``forward()``'s keyword arguments; ``leaf_modules`` are classes kept as one call.

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
:func:`capture` then raises one :class:`~edgetrain.errors.InvalidInput` line naming the
construct, where it is, and what to do (``leaf_modules=(TheModule,)`` among the fixes).
The tracer is fx's own, except that ``a += b`` on a tensor is recorded as ``operator.iadd``
(in place, as eager runs it) where plain fx would record ``a = a + b``.
fx bakes Python values in at trace time (``self.training`` passed to ``F.dropout``, for
example): capture the model in the mode it will run in. fx records only calls, not the
context managers around them; :func:`capture` records which nodes ran inside
``torch.no_grad()`` (or ``set_grad_enabled(False)``, ``inference_mode()``) and inside
``torch.autocast(...)`` regions, and folds each such run of nodes into one :class:`Region`
module that runs them inside the same context (entered with ``with``: an exception leaves the
grad mode and autocast state as they were). A region is one node, so no cut splits it: it is
stored or recomputed whole. A ``forward()`` that assigns to a module attribute
(``self.aux_loss = ...``, ``self.steps += 1``) cannot be captured (the captured step would never
assign it) and is refused, the attribute left as it was.

The metadata run happens under ``torch.no_grad()`` with the RNG state and every buffer restored
afterwards, so capturing leaves the model exactly as it was.

:func:`segments` cuts the graph at positions of that order: position ``c`` lies between node
``c - 1`` and node ``c`` (``0 < c < len(nodes)``). Segment ``k`` takes exactly the values live
across its first cut and returns exactly the values live across its next one: one tensor, or a
tuple of tensors in the order their producers run (the model's inputs first). The first segment
takes the model's input(s) the same way, the last returns what the model returns. A value that
only passes through a segment (a residual skip) comes out as the same tensor object. A cut is
admissible (:func:`all_cuts`) when every live value is a tensor and none of them (nor any view
sharing its storage) is overwritten in place after the cut, so every segment's input stays
intact for a recomputation; :func:`articulation_cuts` are the admissible cuts where exactly one
tensor is live: every path from the input to the output passes through one node (the dominator
cuts Rockmate splits a graph at). Running the segments in sequence is the model's forward,
operation for operation: outputs, gradients and BatchNorm buffers are bitwise equal.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import operator
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from edgetrain import progress
from edgetrain.autograd.storage_counter import storage_key
from edgetrain.errors import InvalidInput
from edgetrain.frontend.concrete import ValueTracer
from edgetrain.frontend.containers import is_container, kept_whole_reason, traced_forward

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_CONCRETE = str(Path(__file__).resolve().parent / "concrete.py")
_KINDS = {"call_module": "module", "call_function": "function", "call_method": "method"}


@dataclass(frozen=True)
class CapturedNode:
    """One operation of a captured graph.

    Attributes:
        name: the fx node's name (unique in the graph).
        kind: ``"module"`` (a leaf module's call), ``"function"`` or ``"method"`` (of a tensor).
        target: the module's path in the model (``layer1.0.conv1``), the function's qualified
            name (``torch.cat``, ``_operator.iadd``) or the method's name (``flatten``).
        reads: the values it reads (model inputs or earlier nodes), each once, in argument order.
        attributes: parameters or buffers it reads directly by path (``embed.weight``), not
            through a leaf module.
        shape, dtype: of its output when that is a tensor, else None.
        bytes: the output tensor's size (elements × element size, in bytes); 0 if not a tensor.
        mutates: the values in ``reads`` it overwrites in place (``relu_``, ``+=``,
            ``ReLU(inplace=True)``).
        alias_of: the value in ``reads`` whose storage its output shares (a view, or the
            in-place result returned), else None.
        last_use: position of the last node that reads its output; ``len(nodes)`` if the model
            returns it; its own position if nothing reads it.
    """

    name: str
    kind: str
    target: str
    reads: tuple[str, ...]
    attributes: tuple[str, ...]
    shape: tuple[int, ...] | None
    dtype: str | None
    bytes: int
    mutates: tuple[str, ...]
    alias_of: str | None
    last_use: int

    @property
    def inplace(self) -> bool:
        """True when the node overwrites one of the values it reads."""
        return bool(self.mutates)

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True)
class Captured:
    """A model traced by :func:`capture`.

    Attributes:
        model: the user's module (the segments share its submodules and parameters).
        graph_module: the fx trace of ``model`` (also sharing them).
        inputs: names of the model's inputs (fx placeholders), in call order.
        input_last_use: for each input, the position of the last node that reads it.
        input_shapes: shape of each sample input.
        nodes: the operations in topological (= execution) order; a node's index is its position.
        outputs: the values the model returns, in order of first appearance in its output.
        reads: the plain Python attributes (a number, string, bool or None; ``_private`` ones
            too; not ``training`` nor what ``nn.Module`` itself keeps on every module)
            ``forward()`` read while traced, as (module, name): fx traced
            their values into the graph, so a step must be planned again when one changes.
        kept_whole: the torch.nn containers with layers inside that stay one node, as (path,
            why), e.g. ``("rnn", "nn.LSTM runs its 2 layers in one fused kernel")``; the others
            are traced into (:mod:`edgetrain.frontend.containers`).
    """

    model: nn.Module
    graph_module: fx.GraphModule
    inputs: tuple[str, ...]
    input_last_use: tuple[int, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    nodes: tuple[CapturedNode, ...]
    outputs: tuple[str, ...]
    reads: tuple[tuple[nn.Module, str], ...] = ()
    kept_whole: tuple[tuple[str, str], ...] = ()
    _cache: dict[str, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def node(self, name: str) -> CapturedNode:
        """The node called ``name`` (KeyError if there is none)."""
        return self.nodes[self._index()[name]]

    def _index(self) -> dict[str, int]:
        index = self._cache.get("index")
        if index is None:
            index = self._cache["index"] = {n.name: i for i, n in enumerate(self.nodes)}
        return index


def capture(
    model: nn.Module,
    sample: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    *,
    leaf_modules: Sequence[type[nn.Module]] = (),
) -> Captured:
    """Trace ``model`` with torch.fx at the sample's shapes and record every node's output.

    ``sample`` is the model's input: a tensor, a sequence of tensors for a model with several
    positional inputs, or a mapping of ``forward()``'s keyword arguments to tensors
    (``{"input_ids": ..., "attention_mask": ...}``); every other argument takes its default.
    ``leaf_modules`` are module classes kept as one call each, their ``forward()`` not traced.
    InvalidInput when the model cannot be traced or does not run on it.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"capture needs an nn.Module, got {type(model).__name__}")
    inputs, keywords = named_inputs(model, sample)
    samples = tuple(inputs.values())
    leaf_types = _leaf_types(leaf_modules)
    before = _snapshot(model)
    buffers = [(b, b.detach().clone(), b._version) for b in model.buffers()]
    failure: Exception | None = None
    try:
        with _tracing() as attribute_reads, torch.enable_grad(), torch.random.fork_rng([]):
            graph, kept_whole, constants = _trace_keeping_updaters_whole(
                model, (inputs, keywords, leaf_types), buffers
            )
    except Exception as exc:
        failure = exc
    finally:
        stored = _restore(before)
        _put_back(buffers)
    if stored:  # the first thing to fix, when tracing also failed (fx on a submodule it made)
        raise InvalidInput(
            f"cannot capture {type(model).__name__}: forward() assigns to {stored} (fx records "
            "calls, not assignments, so the captured step would never update it); return the "
            "value from forward() instead, or update it outside the model"
        ) from failure
    if failure is not None:
        raise InvalidInput(_trace_error(model, failure)) from failure
    graph_module = _graph_module(model, graph, constants)
    _fold_regions(graph_module)
    graph = graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    records = _record(model, graph_module, samples)
    compute = [n for n in graph.nodes if n.op in _KINDS]
    position = {n: i for i, n in enumerate(compute)}
    output_node = next(n for n in graph.nodes if n.op == "output")

    def last_use(node: fx.Node, own: int) -> int:
        uses = [len(compute) if u is output_node else position.get(u, own) for u in node.users]
        return max([own, *uses])

    nodes = []
    for node in compute:
        reads = tuple(a.name for a in _value_inputs(node))
        attributes = tuple(str(a.target) for a in node.all_input_nodes if a.op == "get_attr")
        out, mutated, alias = records[node]
        is_tensor = isinstance(out, torch.Tensor)
        nodes.append(
            CapturedNode(
                name=node.name,
                kind=_KINDS[node.op],
                target=_target_name(node),
                reads=reads,
                attributes=attributes,
                shape=tuple(out.shape) if is_tensor else None,
                dtype=str(out.dtype).removeprefix("torch.") if is_tensor else None,
                bytes=out.numel() * out.element_size() if is_tensor else 0,
                mutates=mutated,
                alias_of=alias,
                last_use=last_use(node, position[node]),
            )
        )
    returned: dict[str, None] = {}
    for value in output_node.all_input_nodes:
        if value.op == "placeholder":
            raise InvalidInput(
                f"{type(model).__name__}.forward returns its input {value.name!r} itself; "
                "return only what it computes (the caller has the input)"
            )
        if value.op in _KINDS:
            returned[value.name] = None
    return Captured(
        model=model,
        graph_module=graph_module,
        inputs=tuple(p.name for p in placeholders),
        input_last_use=tuple(last_use(p, -1) for p in placeholders),
        input_shapes=tuple(tuple(s.shape) for s in samples),
        nodes=tuple(nodes),
        outputs=tuple(returned),
        reads=tuple(attribute_reads),
        kept_whole=tuple(kept_whole.items()),
    )


def live_values(captured: Captured, position: int) -> tuple[str, ...]:
    """The values live across ``position``: produced before it and read at or after it, in the
    order their producers run (inputs first). Position 0 gives the model's inputs, position
    ``len(nodes)`` the values it returns."""
    count = len(captured.nodes)
    if not 0 <= position <= count:
        raise InvalidInput(f"position {position} is outside the graph; use 0 to {count}")
    return _analysis(captured).live[position]


def cut_problem(captured: Captured, position: int) -> str | None:
    """Why a cut at ``position`` is not admissible, or None when it is."""
    count = len(captured.nodes)
    if not 0 < position < count:
        return f"position {position} is not between two nodes (use 1 to {count - 1})"
    return _analysis(captured).problems[position]


@dataclass(frozen=True)
class _Analysis:
    live: tuple[tuple[str, ...], ...]  # per position 0..len(nodes)
    problems: tuple[str | None, ...]  # per position; None = admissible (0 and the end: None)


def _analysis(captured: Captured) -> _Analysis:
    """Live sets and admissibility of every position, in one sweep; computed once per capture."""
    cached = captured._cache.get("analysis")
    if isinstance(cached, _Analysis):
        return cached
    count = len(captured.nodes)
    dying: dict[int, list[str]] = {}
    live: dict[str, None] = {}
    for name, last in zip(captured.inputs, captured.input_last_use, strict=True):
        live[name] = None
        dying.setdefault(max(last, 0), []).append(name)  # an unused input dies at once
    table = [captured.inputs]
    base = _bases(captured)
    last_write = _last_writes(captured, base)
    problems: list[str | None] = [None]
    for position in range(1, count):
        node = captured.nodes[position - 1]
        live[node.name] = None
        dying.setdefault(node.last_use, []).append(node.name)
        for name in dying.pop(position - 1, []):
            live.pop(name, None)
        table.append(tuple(live))
        problems.append(_problem(captured, position, table[-1], base, last_write))
    table.append(captured.outputs)
    problems.append(None)
    result = _Analysis(tuple(table), tuple(problems))
    captured._cache["analysis"] = result
    return result


def _problem(
    captured: Captured,
    position: int,
    live: tuple[str, ...],
    base: dict[str, str],
    last_write: dict[str, int],
) -> str | None:
    for name in live:
        index = captured._index().get(name)
        node = None if index is None else captured.nodes[index]
        if node is not None and not node.is_tensor:
            return f"{name} ({node.target}) is live across it and is not a tensor"
        writer = last_write.get(base[name])
        if writer is not None and writer >= position:
            return (
                f"{name} is live across it and {captured.nodes[writer].name} "
                f"({captured.nodes[writer].target}) overwrites its storage in place later"
            )
    return None


def all_cuts(captured: Captured) -> tuple[int, ...]:
    """Every admissible cut position (live sets of any size), in order."""
    problems = _analysis(captured).problems
    return tuple(c for c in range(1, len(captured.nodes)) if problems[c] is None)


def articulation_cuts(captured: Captured) -> tuple[int, ...]:
    """The admissible cuts across which exactly one tensor is live."""
    live = _analysis(captured).live
    return tuple(c for c in all_cuts(captured) if len(live[c]) == 1)


ALL_CUTS_UP_TO = 1024
"""Stages a model may be cut into at every admissible position; beyond that, fewer cuts keep the
planner's work near a second. A chain of more than
:data:`~edgetrain.planners.search.FLAT_UP_TO` (256) stages is planned over its blocks
(:mod:`edgetrain.planners.blocks`), whose work grows with the number of blocks: ResNet-152's 313
stages (55 blocks) plan in 0.3 s and reach 0.83 × the least memory of cutting
twice per block (``benchmarks/planning.py``)."""


def block_cuts(
    captured: Captured, per_block: int = 2, *, all_up_to: int = ALL_CUTS_UP_TO
) -> tuple[int, ...]:
    """Where edgetrain cuts a captured model into stages: at every admissible position when
    that makes at most ``all_up_to`` stages; otherwise every articulation cut (between blocks),
    and inside each block the ``per_block`` admissible cuts with the least live bytes (a cut
    inside a residual block carries the trunk and the skip). Finer stages let the planner
    recompute inside blocks (the U-Net at batch 4, 128²: least memory 0.33 × plain autograd cut
    everywhere, 67 stages; 0.66 × with 2 cuts per block, 16 stages); ``per_block=0`` gives one
    stage per block."""
    admissible = all_cuts(captured)
    if len(admissible) < all_up_to:
        return admissible
    between = set(articulation_cuts(captured))
    sizes = {n.name: n.bytes for n in captured.nodes}
    chosen = set(between)
    bounds = [0, *sorted(between), len(captured.nodes)]
    for start, stop in itertools.pairwise(bounds):
        inside = [c for c in admissible if start < c < stop]
        if per_block <= 0 or not inside:
            continue
        by_size = sorted(
            inside, key=lambda c: (sum(sizes.get(v, 0) for v in live_values(captured, c)), c)
        )
        chosen.update(by_size[:per_block])
    return tuple(sorted(chosen))


def segments(captured: Captured, cuts: Sequence[int]) -> nn.Sequential:
    """The model as an ``nn.Sequential`` of fx GraphModules, cut at ``cuts`` (increasing,
    admissible positions; see :func:`all_cuts`). See the module docstring for the contract."""
    cuts = list(cuts)
    for index, cut in enumerate(cuts):
        if index and cut <= cuts[index - 1]:
            raise InvalidInput(f"cuts must increase, got {cuts}; sort them and drop repeats")
        problem = cut_problem(captured, cut)
        if problem is not None:
            raise InvalidInput(f"cannot cut at {cut}: {problem}; choose one of all_cuts()")
    bounds = [0, *cuts, len(captured.nodes)]
    return nn.Sequential(
        *(_segment(captured, bounds[k], bounds[k + 1], index=k) for k in range(len(bounds) - 1))
    )


def _segment(captured: Captured, start: int, stop: int, index: int) -> fx.GraphModule:
    source = captured.graph_module.graph
    compute = [n for n in source.nodes if n.op in _KINDS]
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    incoming = live_values(captured, start)
    argument = graph.placeholder("live" if len(incoming) > 1 else incoming[0])
    if len(incoming) == 1:
        env[incoming[0]] = argument
    else:
        for i, name in enumerate(incoming):
            env[name] = graph.call_function(operator.getitem, (argument, i))
    lookup = _copy_nodes(graph, compute[start:stop], env)
    if stop == len(compute):
        output_node = next(n for n in source.nodes if n.op == "output")
        graph.output(fx.map_arg(output_node.args[0], lookup))
    else:
        outgoing = [env[name] for name in live_values(captured, stop)]
        graph.output(outgoing[0] if len(outgoing) == 1 else tuple(outgoing))
    graph.lint()
    return fx.GraphModule(captured.graph_module, graph, class_name=f"Segment{index}")


def _copy_nodes(
    graph: fx.Graph, nodes: list[fx.Node], env: dict[str, fx.Node]
) -> Callable[[fx.Node], fx.Node]:
    """Copy ``nodes`` into ``graph``, each reading the values ``env`` gives by name (and adding
    itself there), and the parameters and buffers they read through one ``get_attr`` each.
    Returns the lookup that maps a source node to its copy, for what reads them after."""
    attributes: dict[str, fx.Node] = {}

    def lookup(node: fx.Node) -> fx.Node:
        if node.op == "get_attr":
            target = str(node.target)
            if target not in attributes:
                attributes[target] = graph.get_attr(target)
            return attributes[target]
        return env[node.name]

    for node in nodes:
        env[node.name] = graph.node_copy(node, lookup)
    return lookup


class _Tracer(ValueTracer):
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
        node.meta[_CONTEXT] = _context()
        return node


_CONTEXT = "edgetrain_context"
Context = tuple[bool, tuple[str, torch.dtype, bool] | None]
"""Where a node runs: grad mode on (True) or off, and the innermost ``torch.autocast`` region
``forward()`` entered around it (device type, dtype, enabled), or None."""
_PLAIN = (bool, int, float, str, type(None))
_MODULE_OWN = frozenset(vars(nn.Module()))  # ``training`` and torch's own bookkeeping
_TRACE_LOCK = threading.Lock()  # one trace at a time: the class patches below are global
_TRACING = threading.local()  # in the tracing thread: its autocast regions and attribute reads


def _context() -> Context | None:
    """The current node's :data:`Context`, or None for the default (grad on, no region)."""
    grad = torch.is_grad_enabled()
    regions = getattr(_TRACING, "regions", None)
    region = regions[-1][1] if regions else None
    return None if grad and region is None else (grad, region)


@contextlib.contextmanager
def _tracing() -> Iterator[dict[tuple[nn.Module, str], None]]:
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


class Region(nn.Module):
    """A run of a captured graph's nodes that ``forward()`` ran inside ``torch.no_grad()`` or a
    ``torch.autocast`` region, as one module: ``body`` (an ``fx.GraphModule`` sharing the
    model's modules) runs inside the same context, entered with ``with`` so that an exception
    leaves the grad mode and autocast state as they were. Autocast runs without its cache of
    weight copies, as the executor runs every stage (a copy lives as long as autograd saves it).
    """

    def __init__(self, body: fx.GraphModule, grad: bool, autocast: Any) -> None:
        super().__init__()
        self.body = body
        self.grad = grad
        self.autocast: tuple[str, torch.dtype, bool] | None = autocast

    def forward(self, *args: Any) -> Any:
        with contextlib.ExitStack() as stack:
            if self.autocast is not None:
                device, dtype, enabled = self.autocast
                stack.enter_context(
                    torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=False)
                )
            if not self.grad:
                stack.enter_context(torch.no_grad())
            return self.body(*args)

    def extra_repr(self) -> str:
        where = [] if self.grad else ["no_grad"]
        if self.autocast is not None:
            device, dtype, enabled = self.autocast
            where.append(f"autocast({device!r}, {dtype}, enabled={enabled})")
        return ", ".join(where)


def _fold_regions(graph_module: fx.GraphModule) -> None:
    """Replace each run of consecutive nodes traced in the same non-default :data:`Context` by
    one call of a :class:`Region` (registered on ``graph_module`` as ``_region<k>``)."""
    graph = graph_module.graph
    runs: list[tuple[Context, list[fx.Node]]] = []
    previous = None  # the last node that is not a get_attr (those are looked up where read)
    for node in graph.nodes:
        if node.op == "get_attr":
            continue
        state = node.meta.get(_CONTEXT) if node.op in _KINDS else None
        if state is not None:
            if runs and runs[-1][0] == state and runs[-1][1][-1] is previous:
                runs[-1][1].append(node)
            else:
                runs.append((state, [node]))
        previous = node
    for index, (state, members) in enumerate(runs):
        _fold(graph_module, f"_region{index}", state, members)
    graph.lint()
    graph_module.recompile()


def _fold(graph_module: fx.GraphModule, name: str, state: Context, members: list[fx.Node]) -> None:
    """Fold ``members`` into a call of a :class:`Region` named ``name``: what they read from
    before the run are its arguments, what later nodes read of them its result (a tuple, taken
    apart with ``getitem``, when several)."""
    graph = graph_module.graph
    inside = set(members)
    reads = {
        v: None
        for m in members
        for v in m.all_input_nodes
        if v not in inside and v.op != "get_attr"  # a get_attr is looked up where read
    }
    results = [m for m in members if any(u not in inside for u in m.users)]
    body = fx.Graph()
    env = {value.name: body.placeholder(value.name) for value in reads}
    _copy_nodes(body, members, env)
    outputs = [env[r.name] for r in results]
    body.output(outputs[0] if len(outputs) == 1 else tuple(outputs) if outputs else None)
    graph_module.add_submodule(name, Region(fx.GraphModule(graph_module, body), *state))
    with graph.inserting_before(members[0]):  # in order, before the run (erased below)
        call = graph.call_module(name, tuple(reads))
        replacements = [call]
        if len(results) > 1:
            replacements = [
                graph.call_function(operator.getitem, (call, i)) for i in range(len(results))
            ]
    for result, replacement in zip(results, replacements, strict=True):
        for user in [u for u in result.users if u not in inside]:
            user.replace_input_with(result, replacement)
    for member in reversed(members):
        graph.erase_node(member)


def _trace_keeping_updaters_whole(
    model: nn.Module, given: _Given, buffers: _Saved
) -> tuple[fx.Graph, dict[str, str], dict[str, torch.Tensor]]:
    """Trace ``model``; when a submodule's forward updates its buffers in place (fx runs it on
    the real buffers), trace again with each such submodule kept as one call, so that the
    captured step runs its update as plain autograd does. InvalidInput when ``model``'s own
    forward updates a buffer in place (it cannot be kept whole)."""
    versions = [b._version for b, _, _ in buffers]
    tracer = _Tracer(given)
    graph = tracer.run(model)
    if tracer.updaters:
        _put_back(buffers)
        versions = [b._version for b, _, _ in buffers]
        tracer = _Tracer(given, frozenset(id(m) for m in tracer.updaters.values()))
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
    names = [n for n in tracer.tensor_attrs.values() if n.startswith(_CONST)]
    constants = {n: _unexpanded(own.pop(n)) for n in names}
    return graph, tracer.kept_whole, constants


def _unexpanded(tensor: torch.Tensor) -> torch.Tensor:
    """A constant as the graph module holds it (a buffer): an expanded one (``t.expand(B, T)``,
    several elements in one place) as a copy, so it can be copied into."""
    expanded = any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.shape, strict=True))
    return tensor.clone() if expanded else tensor


_CONST = "_tensor_constant"  # fx's name for a tensor the trace made (torch.arange(T))


def _graph_module(
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


def _put_back(buffers: _Saved) -> None:
    """Copy each buffer's saved value back into it if tracing updated it in place."""
    with torch.no_grad():
        for buffer, value, version in buffers:
            if buffer._version != version:
                buffer.copy_(value)


_Snapshot = list[tuple[str, nn.Module, dict[str, Any], list[dict[str, Any]]]]


def _snapshot(model: nn.Module) -> _Snapshot:
    """Each module's path, itself, its ``vars()`` and its module, parameter and buffer dicts,
    as shallow copies: what :func:`_restore` puts back."""
    return [
        (path, m, dict(vars(m)), [dict(m._modules), dict(m._parameters), dict(m._buffers)])
        for path, m in model.named_modules()
    ]


def _restore(before: _Snapshot) -> str | None:
    """Undo what tracing ``forward()`` assigned to the modules ``before`` lists (attributes,
    submodules, parameters, buffers); returns the first it assigned (``"head.aux_loss"``: a
    traced value, an fx Proxy; a counter ``self.steps += 1``; a submodule made in forward), or
    None."""
    stored = None
    for path, module, attributes, registries in before:
        now = [vars(module), module._modules, module._parameters, module._buffers]
        for current, old in zip(now, [attributes, *registries], strict=True):
            changed = [n for n, v in current.items() if old.get(n, _MISSING) is not v]
            changed += [n for n in old if n not in current]
            assigned = [n for n in changed if not n.startswith(_CONST)]  # not fx's constants
            if assigned and stored is None:
                stored = f"{path}.{assigned[0]}" if path else assigned[0]
            if changed:
                current.clear()
                current.update(old)
    return stored


_MISSING = object()


def named_inputs(model: nn.Module, sample: Any) -> tuple[dict[str, torch.Tensor], bool]:
    """The sample as ``forward()``'s arguments by name, and whether they are passed by keyword
    (a mapping) rather than by position (a tensor or a sequence of tensors)."""
    keywords = isinstance(sample, Mapping)
    given = (
        dict(sample)
        if keywords
        else dict(enumerate((sample,) if isinstance(sample, torch.Tensor) else tuple(sample)))
    )
    for key, value in given.items():
        if not isinstance(value, torch.Tensor):
            what = f"argument {key!r}" if keywords else f"input {key}"
            raise InvalidInput(
                f"the sample's {what} is a {type(value).__name__}; give tensors only (set "
                "options such as return_dict on the model or its config)"
            )
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        signature = None
    if keywords:
        if signature is not None:
            try:
                signature.bind(**given)
            except TypeError as exc:
                raise InvalidInput(
                    f"{type(model).__name__}.forward does not take the sample's keyword "
                    f"arguments ({exc}); pass the names forward() takes"
                ) from None
        return {str(k): v for k, v in given.items()}, True
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [] if signature is None else list(signature.parameters.values())
    names = [p.name for p in params if p.kind in kinds]
    variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    required = [p for p in params if p.kind in kinds and p.default is p.empty]
    if signature is not None and (
        len(given) < len(required) or (len(given) > len(names) and not variadic)
    ):
        raise InvalidInput(
            f"{type(model).__name__}.forward takes {len(names)} inputs but the sample has "
            f"{len(given)}; pass one tensor per input of forward()"
        )
    names += [f"input_{i}" for i in range(len(names), len(given))]
    return dict(zip(names, given.values(), strict=False)), False


def _leaf_types(leaf_modules: Any) -> tuple[type[nn.Module], ...]:
    kinds = (leaf_modules,) if isinstance(leaf_modules, type) else tuple(leaf_modules)
    for kind in kinds:
        if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
            raise InvalidInput(
                f"leaf_modules takes nn.Module classes, got {kind!r}; pass e.g. "
                "leaf_modules=(MyBlock,)"
            )
    return kinds


def _value_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if a.op == "placeholder" or a.op in _KINDS]


def _target_name(node: fx.Node) -> str:
    if node.op == "call_function":
        try:
            return fx.node._get_qualified_name(node.target)  # type: ignore[arg-type]
        except Exception:  # an unusual callable: its plain name is enough
            return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def _bases(captured: Captured) -> dict[str, str]:
    """Each value's storage owner: itself, or the base of the value it aliases."""
    base = {name: name for name in captured.inputs}
    for node in captured.nodes:
        base[node.name] = base[node.alias_of] if node.alias_of is not None else node.name
    return base


def _last_writes(captured: Captured, base: dict[str, str]) -> dict[str, int]:
    """For each storage owner, the position of the last node that overwrites it in place."""
    writes: dict[str, int] = {}
    for position, node in enumerate(captured.nodes):
        for name in node.mutates:
            writes[base[name]] = position
    return writes


Record = tuple[Any, tuple[str, ...], str | None]


class _Recorder(fx.Interpreter):
    """Runs the graph and notes, per node, its output, what it overwrote, what it aliases."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.records: dict[fx.Node, Record] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in _KINDS:
            return super().run_node(n)
        reads = [(a.name, self.env[a]) for a in _value_inputs(n)]
        tensors = [(name, v) for name, v in reads if isinstance(v, torch.Tensor)]
        versions = [v._version for _, v in tensors]
        out = super().run_node(n)
        mutated = tuple(
            name for (name, v), seen in zip(tensors, versions, strict=True) if v._version != seen
        )
        alias = None
        if isinstance(out, torch.Tensor):
            key = storage_key(out)
            alias = next((name for name, v in tensors if storage_key(v) == key), None)
        self.records[n] = (_shape_only(out), mutated, alias)
        return out


def _shape_only(out: Any) -> Any:
    """Keep a tensor's metadata, not its data (a meta tensor of the same shape and dtype)."""
    if isinstance(out, torch.Tensor):
        return torch.empty(out.shape, dtype=out.dtype, device="meta")
    return None


def _record(
    model: nn.Module, graph_module: fx.GraphModule, samples: tuple[torch.Tensor, ...]
) -> dict[fx.Node, Record]:
    recorder = _Recorder(graph_module)
    with _restored(model), torch.no_grad():
        try:
            recorder.run(*(s.detach() for s in samples))
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidInput(
                f"{type(model).__name__} does not run on the sample "
                f"{[tuple(s.shape) for s in samples]}: {first}; give an input the model accepts"
            ) from exc
    return recorder.records


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Restore the RNG state and every buffer (BatchNorm statistics) on exit."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)


def _trace_error(model: nn.Module, exc: Exception) -> str:
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
