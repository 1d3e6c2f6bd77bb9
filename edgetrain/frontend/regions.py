"""fx records only calls, not the context managers around them;
:func:`~edgetrain.frontend.fx_capture.capture` records which nodes ran inside ``torch.no_grad()``
(or ``set_grad_enabled(False)``, ``inference_mode()``) and inside ``torch.autocast(...)`` regions,
and folds each such run of nodes into one :class:`Region` module that runs them inside the same
context (entered with ``with``: an exception leaves the grad mode and autocast state as they
were). A region is one node, so no cut splits it: it is stored or recomputed whole.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch import fx, nn

from edgetrain.frontend.captured import KINDS
from edgetrain.frontend.fx_tracer import CONTEXT, Context
from edgetrain.frontend.graph_segments import copy_nodes


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


def fold_regions(graph_module: fx.GraphModule) -> None:
    """Replace each run of consecutive nodes traced in the same non-default :data:`Context` by
    one call of a :class:`Region` (registered on ``graph_module`` as ``_region<k>``)."""
    graph = graph_module.graph
    runs: list[tuple[Context, list[fx.Node]]] = []
    previous = None  # the last node that is not a get_attr (those are looked up where read)
    for node in graph.nodes:
        if node.op == "get_attr":
            continue
        state = node.meta.get(CONTEXT) if node.op in KINDS else None
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
    copy_nodes(body, members, env)
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
