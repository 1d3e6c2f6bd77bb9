"""The stretches of a placed graph model a rank may recompute, and what each costs (torch).

A stretch (:func:`edgetrain.tiles.rankplan.stretches`) is a run of operations with one input
and one output that communicates with no other rank: a residual block of the replicated tail
past the cut, or of the front between two halo exchanges. Its unit (named by its first
operation's position) saves the values computed inside it but the last, and costs their forward
work again.
"""

from __future__ import annotations

from torch import fx

from edgetrain.tiles.graph import SUMMED, TILED, NodeInfo, Placement
from edgetrain.tiles.rankplan import Operation, Stretch, Unit, stretches


def _local(node: fx.Node, placement: Placement) -> bool:
    name = node.name
    if node.op in ("placeholder", "output") or placement.where[name] == SUMMED:
        return False
    if name in placement.gathers:
        return False
    if name in placement.window_needs:  # a halo exchange unless it reads the image
        return all(placement.where[a.name] != TILED for a in node.all_input_nodes)
    return True


def graph_stretches(
    graph: fx.GraphModule, infos: tuple[NodeInfo, ...], placement: Placement
) -> tuple[Stretch, ...]:
    """The stretches of ``graph`` placed by ``placement`` that a rank may recompute."""
    kinds = {i.node.name: i.kind for i in infos}
    operations = [
        Operation(
            node.name,
            tuple(a.name for a in node.all_input_nodes),
            kinds.get(node.name) in ("window", "transposed"),
            _local(node, placement),
        )
        for node in graph.graph.nodes
    ]
    return stretches(operations)


def graph_units(
    graph: fx.GraphModule,
    infos: tuple[NodeInfo, ...],
    placement: Placement,
    macs_per_second: float,
) -> tuple[Unit, ...]:
    """One unit per recomputable stretch: the bytes of the values it computes but its result
    (a tile's share of a tiled one), and the seconds of its forward work on one rank."""
    grid = placement.grid
    units = []
    for stretch in graph_stretches(graph, infos, placement):
        saved, macs = 0, 0.0
        for info in infos[stretch.start : stretch.stop]:
            tiled = placement.where[info.node.name] == TILED
            share = 1.0 / grid.size if tiled else 1.0
            if info.shape is not None and info.node.name != stretch.result:
                count = 1
                for extent in info.shape:
                    count *= extent
                saved += int(count * info.element_bytes * share)
            macs += info.macs * share
        units.append(Unit(stretch.start, saved, macs / macs_per_second))
    return tuple(units)
