"""Where a captured graph can be cut: the values live across each position, and which cuts are
admissible.

A cut is admissible (:func:`all_cuts`) when every live value is a tensor and none of them (nor any
view sharing its storage) is overwritten in place after the cut, so every segment's input stays
intact for a recomputation; :func:`articulation_cuts` are the admissible cuts where exactly one
tensor is live: every path from the input to the output passes through one node (the dominator
cuts Rockmate splits a graph at). :func:`block_cuts` picks the cuts a planner gets.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from edgetrain.errors import InvalidInput
from edgetrain.frontend.captured import Captured


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
