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

The metadata run happens under ``torch.no_grad()`` with the RNG state and every buffer restored
afterwards, so capturing leaves the model exactly as it was.

The parts: the tracer (:mod:`edgetrain.frontend.fx_tracer`), the folding of ``no_grad`` and
autocast runs into :class:`Region` modules (:mod:`edgetrain.frontend.regions`), the run that
records each node (:mod:`edgetrain.frontend.recording`), Hugging Face's attention masks built
by broadcasting while tracing (:mod:`edgetrain.frontend.mask_broadcast`), the captured graph
(:mod:`edgetrain.frontend.captured`), which cuts are admissible
(:mod:`edgetrain.frontend.cut_analysis`) and the segments between them
(:mod:`edgetrain.frontend.graph_segments`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from edgetrain.errors import InvalidInput
from edgetrain.frontend.captured import KINDS, Captured, CapturedNode, value_inputs
from edgetrain.frontend.cut_analysis import (
    ALL_CUTS_UP_TO,
    all_cuts,
    articulation_cuts,
    block_cuts,
    cut_problem,
    live_values,
)
from edgetrain.frontend.fx_tracer import (
    noting_contexts,
    put_back,
    trace_error,
    trace_keeping_updaters_whole,
    traced_module,
)
from edgetrain.frontend.graph_segments import segments
from edgetrain.frontend.mask_broadcast import broadcasting_masks
from edgetrain.frontend.model_state import restore_snapshot, snapshot
from edgetrain.frontend.recording import record_nodes
from edgetrain.frontend.regions import Region, fold_regions

__all__ = [
    "ALL_CUTS_UP_TO",
    "Captured",
    "CapturedNode",
    "Region",
    "all_cuts",
    "articulation_cuts",
    "block_cuts",
    "capture",
    "cut_problem",
    "live_values",
    "named_inputs",
    "segments",
]


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
    before = snapshot(model)
    buffers = [(b, b.detach().clone(), b._version) for b in model.buffers()]
    failure: Exception | None = None
    try:
        with (
            noting_contexts() as attribute_reads,
            broadcasting_masks(),
            torch.enable_grad(),
            torch.random.fork_rng([]),
        ):
            graph, kept_whole, constants = trace_keeping_updaters_whole(
                model, (inputs, keywords, leaf_types), buffers
            )
    except Exception as exc:
        failure = exc
    finally:
        stored = restore_snapshot(before)
        put_back(buffers)
    if stored:  # the first thing to fix, when tracing also failed (fx on a submodule it made)
        raise InvalidInput(
            f"cannot capture {type(model).__name__}: forward() assigns to {stored} (fx records "
            "calls, not assignments, so the captured step would never update it); return the "
            "value from forward() instead, or update it outside the model"
        ) from failure
    if failure is not None:
        raise InvalidInput(trace_error(model, failure)) from failure
    graph_module = traced_module(model, graph, constants)
    fold_regions(graph_module)
    graph = graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    records = record_nodes(model, graph_module, samples)
    compute = [n for n in graph.nodes if n.op in KINDS]
    position = {n: i for i, n in enumerate(compute)}
    output_node = next(n for n in graph.nodes if n.op == "output")

    def last_use(node: fx.Node, own: int) -> int:
        uses = [len(compute) if u is output_node else position.get(u, own) for u in node.users]
        return max([own, *uses])

    nodes = []
    for node in compute:
        reads = tuple(a.name for a in value_inputs(node))
        attributes = tuple(str(a.target) for a in node.all_input_nodes if a.op == "get_attr")
        out, mutated, alias = records[node]
        is_tensor = isinstance(out, torch.Tensor)
        nodes.append(
            CapturedNode(
                name=node.name,
                kind=KINDS[node.op],
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
        if value.op in KINDS:
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


def _target_name(node: fx.Node) -> str:
    if node.op == "call_function":
        try:
            return fx.node._get_qualified_name(node.target)  # type: ignore[arg-type]
        except Exception:  # an unusual callable: its plain name is enough
            return getattr(node.target, "__name__", str(node.target))
    return str(node.target)
