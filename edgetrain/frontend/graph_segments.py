"""A captured graph cut into runnable segments.

:func:`segments` cuts the graph at positions of its node order: position ``c`` lies between node
``c - 1`` and node ``c`` (``0 < c < len(nodes)``). Segment ``k`` takes exactly the values live
across its first cut and returns exactly the values live across its next one: one tensor, or a
tuple of tensors in the order their producers run (the model's inputs first). The first segment
takes the model's input(s) the same way, the last returns what the model returns. A value that
only passes through a segment (a residual skip) comes out as the same tensor object. Running the
segments in sequence is the model's forward, operation for operation: outputs, gradients and
BatchNorm buffers are bitwise equal.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

from torch import fx, nn

from edgetrain.errors import InvalidInput
from edgetrain.frontend.captured import KINDS, Captured
from edgetrain.frontend.cut_analysis import cut_problem, live_values


def segments(captured: Captured, cuts: Sequence[int]) -> nn.Sequential:
    """The model as an ``nn.Sequential`` of fx GraphModules, cut at ``cuts`` (increasing,
    admissible positions; see :func:`~edgetrain.frontend.cut_analysis.all_cuts`). See the module
    docstring for the contract."""
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
    compute = [n for n in source.nodes if n.op in KINDS]
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    incoming = live_values(captured, start)
    argument = graph.placeholder("live" if len(incoming) > 1 else incoming[0])
    if len(incoming) == 1:
        env[incoming[0]] = argument
    else:
        for i, name in enumerate(incoming):
            env[name] = graph.call_function(operator.getitem, (argument, i))
    lookup = copy_nodes(graph, compute[start:stop], env)
    if stop == len(compute):
        output_node = next(n for n in source.nodes if n.op == "output")
        graph.output(fx.map_arg(output_node.args[0], lookup))
    else:
        outgoing = [env[name] for name in live_values(captured, stop)]
        graph.output(outgoing[0] if len(outgoing) == 1 else tuple(outgoing))
    graph.lint()
    return fx.GraphModule(captured.graph_module, graph, class_name=f"Segment{index}")


def copy_nodes(
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
