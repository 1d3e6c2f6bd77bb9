"""TrainingGraph: a training step as a DAG of forward and backward nodes, with costs (pure).

A node is one operation of a training step (a layer's forward, a layer's backward, the loss). It
produces one output tensor of ``output_bytes``; an edge ``(u, v)`` says that ``v`` reads ``u``'s
output. Each node carries what running it costs on one device (``compute_seconds``,
``compute_joules``) and what moving its output to and from secondary storage costs
(``pagein_seconds``/``pagein_joules``, ``pageout_seconds``/``pageout_joules``). Nothing here
assumes a chain: any DAG in topological order is a graph (a model captured with ``torch.fx`` is
one), and the MILP planner (:mod:`edgetrain.planners.poet.milp`) reads only these numbers.

Nodes are stored in a topological order: every edge goes from a lower index to a higher one, and
node ``t`` is what stage ``t`` of a schedule computes. Parallel edges are allowed (POET's own graphs
have one) and kept, because POET's memory recurrence frees a value once per edge.

Three ways in:

* :func:`from_chain`: a :class:`~edgetrain.core.chain.Chain` plus an
  :class:`~edgetrain.devices.energy.EnergyProfile` (forward and backward of every stage, the loss,
  and the edges autograd has);
* :func:`from_poet`: a POET instance in the ``poet-instance-v1`` format;
* :func:`from_dict` / :func:`load`: edgetrain's own ``edgetrain-graph`` JSON (see :meth:`to_dict`),
  or either of the other formats in a file.

Every reader validates what it reads and raises :class:`~edgetrain.errors.CorruptFile` (a file) or
:class:`~edgetrain.errors.InvalidInput` (a value) with one line naming the problem: a wrong format
tag, a cycle, an edge to a missing node, a negative size or cost.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.jsonfile import read_json

if TYPE_CHECKING:
    from edgetrain.core.chain import Chain
    from edgetrain.devices.energy import EnergyProfile

FORMAT = "edgetrain-graph-v1"
POET_FORMAT = "poet-instance-v1"

_COSTS = (
    "workspace_bytes",
    "compute_seconds",
    "compute_joules",
    "output_bytes",
    "pagein_seconds",
    "pagein_joules",
    "pageout_seconds",
    "pageout_joules",
)


@dataclass(frozen=True)
class Node:
    """One operation of a training step and what it costs.

    Attributes:
        name: a label (layer name, ``"loss"``, ``"grad:conv1"`` ...).
        backward: True for a node of the backward pass (a gradient), False for a forward node.
        compute_seconds: one execution (seconds).
        compute_joules: energy of one execution (joules).
        output_bytes: size of the node's output tensor, what stays in RAM while it is kept (bytes).
        pagein_seconds: time to read the output back from secondary storage (seconds).
        pagein_joules: energy of that read (joules).
        pageout_seconds: time to write the output to secondary storage (seconds).
        pageout_joules: energy of that write (joules).
        stage: for a graph made from a chain, the chain stage the node belongs to (the loss: -1);
            None otherwise.
        workspace_bytes: transient memory while the node runs, above its inputs and output, freed
            when it finishes (bytes; e.g. weight gradients a backward allocates). Counted by the
            ``edgetrain`` accounting; POET has no such term.
    """

    name: str
    backward: bool
    compute_seconds: float
    compute_joules: float
    output_bytes: float
    pagein_seconds: float = 0.0
    pagein_joules: float = 0.0
    pageout_seconds: float = 0.0
    pageout_joules: float = 0.0
    stage: int | None = None
    workspace_bytes: float = 0.0


@dataclass(frozen=True)
class TrainingGraph:
    """A training step's DAG: nodes in topological order and the edges between them.

    Attributes:
        nodes: the nodes; a node's index is its id and the stage that computes it.
        edges: ``(u, v)`` pairs, ``v`` reads ``u``'s output, ``u < v``; parallel edges allowed.
        name: a label.
        device: the name of the device profile the costs are for ("" if unknown).
        held: ``(stage, bytes)`` pairs: bytes held from the start of that stage to the end of the
            step that no node accounts for (for a chain: the model's output, which the caller
            keeps, its gradient during the backward pass, and the parameter gradients each backward
            leaves). Counted by the ``edgetrain`` accounting, ignored by the ``poet`` accounting.
        retains: ``(v, u)`` pairs: while ``v``'s output is held, ``u``'s output is held too
            (autograd's record of ``v`` saved ``u``, e.g. a convolution's input): ``v`` cannot be
            kept without ``u``. Respected by the ``edgetrain`` accounting; POET ignores it.
    """

    nodes: tuple[Node, ...]
    edges: tuple[tuple[int, int], ...]
    name: str = ""
    device: str = ""
    held: tuple[tuple[int, float], ...] = ()
    retains: tuple[tuple[int, int], ...] = ()
    _preds: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.nodes)
        if n == 0:
            raise InvalidInput("a training graph needs at least one node")
        for i, node in enumerate(self.nodes):
            for name in _COSTS:
                value = getattr(node, name)
                if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                    raise InvalidInput(
                        f"node {i} ({node.name!r}) has {name} {value!r}; "
                        "sizes, times and energies must be finite numbers >= 0"
                    )
        for stage, size in self.held:
            if size < 0 or not 0 <= stage < n:
                raise InvalidInput(
                    f"held ({stage}, {size}) needs a stage in 0..{n - 1} and bytes >= 0"
                )
        for u, v in self.edges:
            if not (0 <= u < n and 0 <= v < n):
                raise InvalidInput(f"edge ({u}, {v}) names a missing node; ids run 0..{n - 1}")
        for v, u in self.retains:
            if not (0 <= u < n and 0 <= v < n) or u == v:
                raise InvalidInput(
                    f"retains pair ({v}, {u}) names a missing node; ids run 0..{n - 1}"
                )
        _check_acyclic(n, self.edges)
        for u, v in self.edges:
            if u >= v:
                raise InvalidInput(
                    f"edge ({u}, {v}) goes backwards; list the nodes in topological order"
                )
        preds: list[list[int]] = [[] for _ in range(n)]
        succs: list[list[int]] = [[] for _ in range(n)]
        for u, v in self.edges:
            preds[v].append(u)
            succs[u].append(v)
        object.__setattr__(self, "_preds", tuple(tuple(p) for p in preds))
        object.__setattr__(self, "_succs", tuple(tuple(sorted(set(s))) for s in succs))

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def predecessors(self, v: int) -> tuple[int, ...]:
        """Nodes whose output ``v`` reads, once per edge (parallel edges repeat)."""
        return self._preds[v]

    def successors(self, u: int) -> tuple[int, ...]:
        """Distinct nodes that read ``u``'s output, ascending."""
        return self._succs[u]

    @property
    def unique_edges(self) -> tuple[tuple[int, int], ...]:
        """The edges without repeats, in their first order."""
        return tuple(dict.fromkeys(self.edges))

    def graph_readers(self) -> dict[int, int]:
        """Forward node -> the backward node of the same chain stage that reads it (the backward
        that needs the autograd graph that forward built)."""
        nodes = self.nodes
        return {
            f: b
            for f, b in self.unique_edges
            if not nodes[f].backward
            and nodes[b].backward
            and nodes[f].stage is not None
            and nodes[f].stage == nodes[b].stage
        }

    @property
    def compute_seconds(self) -> float:
        """Every node once (seconds): the step without recomputation or paging."""
        return sum(n.compute_seconds for n in self.nodes)

    @property
    def compute_joules(self) -> float:
        """Every node once (joules): a lower bound on any schedule's energy."""
        return sum(n.compute_joules for n in self.nodes)

    # -- edgetrain's own JSON ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The graph as edgetrain's ``edgetrain-graph-v1`` JSON object (see :func:`from_dict`)."""
        return {
            "format": FORMAT,
            "name": self.name,
            "device": self.device,
            "held": [[stage, size] for stage, size in self.held],
            "retains": [list(p) for p in self.retains],
            "nodes": [asdict(n) for n in self.nodes],
            "edges": [list(e) for e in self.edges],
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as text."""
        return json.dumps(self.to_dict(), indent=1)


def _check_acyclic(n: int, edges: Sequence[tuple[int, int]]) -> None:
    """Kahn's algorithm; raise InvalidInput naming a node on a cycle."""
    indegree = [0] * n
    out: list[list[int]] = [[] for _ in range(n)]
    for u, v in edges:
        out[u].append(v)
        indegree[v] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        for v in out[u]:
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    if seen < n:
        on_cycle = min(i for i in range(n) if indegree[i] > 0)
        raise InvalidInput(
            f"the graph has a cycle through node {on_cycle}; a training graph must be acyclic"
        )


# -- readers ---------------------------------------------------------------------------------------


def from_dict(data: Any) -> TrainingGraph:
    """A graph from a parsed JSON object: ``edgetrain-graph-v1`` or ``poet-instance-v1``.

    ``edgetrain-graph-v1``: ``{"format": "edgetrain-graph-v1", "name": str, "device": str,
    "held": [[stage, bytes], ...], "retains": [[v, u], ...], "nodes": [{"name",
    "backward", "compute_seconds", "compute_joules", "output_bytes", "pagein_seconds",
    "pagein_joules", "pageout_seconds", "pageout_joules", "stage", "workspace_bytes"}, ...],
    "edges": [[u, v], ...]}``; nodes in topological order (every edge ``u < v``), the paging
    fields optional (0). Raises :class:`CorruptFile` for a wrong format tag or a missing or
    mistyped field, :class:`InvalidInput` for a cycle, a missing node or a negative value.
    """
    if not isinstance(data, dict):
        raise CorruptFile(f"not a training graph; expected a JSON object with format {FORMAT!r}")
    tag = data.get("format")
    if tag == POET_FORMAT:
        return from_poet(data)
    if tag != FORMAT:
        raise CorruptFile(f"graph format tag is {tag!r}; expected {FORMAT!r} or {POET_FORMAT!r}")
    try:
        nodes = tuple(
            Node(
                name=str(raw.get("name", f"n{i}")),
                backward=bool(raw["backward"]),
                compute_seconds=_number(raw["compute_seconds"]),
                compute_joules=_number(raw["compute_joules"]),
                output_bytes=_number(raw["output_bytes"]),
                pagein_seconds=_number(raw.get("pagein_seconds", 0.0)),
                pagein_joules=_number(raw.get("pagein_joules", 0.0)),
                pageout_seconds=_number(raw.get("pageout_seconds", 0.0)),
                pageout_joules=_number(raw.get("pageout_joules", 0.0)),
                stage=None if raw.get("stage") is None else int(raw["stage"]),
                workspace_bytes=_number(raw.get("workspace_bytes", 0.0)),
            )
            for i, raw in enumerate(data["nodes"])
        )
        edges = _edges(data["edges"])
        held = tuple((int(a), _number(b)) for a, b in data.get("held", []))
        retains = _edges(data.get("retains", []))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptFile(
            f"graph JSON is malformed ({_why(exc)}); see {FORMAT} in docs/poet.md"
        ) from exc
    return TrainingGraph(
        nodes,
        edges,
        str(data.get("name", "")),
        str(data.get("device", "")),
        held,
        retains,
    )


def from_poet(data: dict[str, Any]) -> TrainingGraph:
    """A graph from a POET instance (``poet-instance-v1``, POET's own instance format).

    Node ``i`` of the instance is node ``i`` of the graph; ``runtime_s`` becomes
    ``compute_seconds``, ``compute_energy_J`` ``compute_joules``, and so on. The edge list is kept
    as POET has it, parallel edges included.
    """
    if data.get("format") != POET_FORMAT:
        raise CorruptFile(f"format tag is {data.get('format')!r}; expected {POET_FORMAT!r}")
    try:
        raw_nodes = sorted(data["nodes"], key=lambda raw: int(raw["id"]))
        if [int(raw["id"]) for raw in raw_nodes] != list(range(len(raw_nodes))):
            raise ValueError("node ids must be 0..T-1")
        nodes = tuple(
            Node(
                name=str(raw.get("name", raw["id"])),
                backward=bool(raw["backward"]),
                compute_seconds=_number(raw["runtime_s"]),
                compute_joules=_number(raw["compute_energy_J"]),
                output_bytes=_number(raw["output_bytes"]),
                pagein_seconds=_number(raw["pagein_time_s"]),
                pagein_joules=_number(raw["pagein_energy_J"]),
                pageout_seconds=_number(raw["pageout_time_s"]),
                pageout_joules=_number(raw["pageout_energy_J"]),
            )
            for raw in raw_nodes
        )
        edges = _edges(data["edges"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptFile(
            f"POET instance is malformed ({_why(exc)}); see poet-instance-v1"
        ) from exc
    name = f"{data.get('model', 'poet')}@{data.get('platform', '?')}"
    return TrainingGraph(nodes, edges, name, str(data.get("platform", "")))


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def _edges(raw: Any) -> tuple[tuple[int, int], ...]:
    edges = []
    for pair in raw:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise ValueError(f"edge {pair!r} is not a pair [u, v]")
        u, v = pair
        if (
            isinstance(u, bool)
            or isinstance(v, bool)
            or not isinstance(u, int)
            or not isinstance(v, int)
        ):
            raise TypeError(f"edge {pair!r} does not name two node ids")
        edges.append((u, v))
    return tuple(edges)


def _why(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}"
    return str(exc)


def load(path: str | Path) -> TrainingGraph:
    """Read a graph file (``edgetrain-graph-v1`` or ``poet-instance-v1`` JSON)."""
    return from_dict(read_json(path, "graph", f"write it as {FORMAT} or {POET_FORMAT}"))


# -- from a chain ----------------------------------------------------------------------------------


def from_chain(
    chain: Chain, device: EnergyProfile, *, chain_flops_per_second: float = 1e9
) -> TrainingGraph:
    """The training graph of a chain on ``device``.

    Nodes, for a chain of ``L`` stages: ``F0 .. F(L-1)`` (forward of each stage), ``loss`` (the
    gradient of the output, no compute), then ``B(L-1) .. B0`` (backward of each stage), so
    ``T = 2L + 1``. Edges are what autograd reads: ``F(k-1) -> F(k)`` (the input ``a[k]``),
    ``F(k) -> B(k)`` (the stage's output and saved tensors), ``F(k-1) -> B(k)`` when the stage saves
    its input, ``B(k+1) -> B(k)`` (the gradient of ``a[k+1]``, from ``loss`` for the last stage) and
    ``F(L-1) -> loss``. The chain's input ``a[0]`` is held by the caller and is no node.

    Sizes: ``F(k)`` outputs ``output_bytes + saved_bytes`` (what a forward with grad keeps),
    ``B(k)`` the gradient of ``a[k]``; ``loss`` is a marker of no size. ``held``: the output's
    gradient from the first backward on, the output (kept by the caller) once the last stage's
    forward node is freed, and each backward's parameter gradients after it, as
    :func:`edgetrain.core.simulator.simulate` counts them. A stage's measured transient
    peaks (forward with grad, backward) beyond the node's output become its ``workspace_bytes``,
    so the ``edgetrain`` accounting of the keep-everything plan is
    :func:`edgetrain.core.simulator.simulate`'s peak.

    Paging a forward node costs the device's figures for the stage's output ``a[k+1]`` alone:
    that is what an executor pages (a checkpoint); the saved tensors of a graph are never paged.

    Costs: a stage's seconds are turned into floating-point operations at
    ``chain_flops_per_second`` (the speed the chain was timed or estimated at:
    :data:`edgetrain.frontend.profiling.NOMINAL_FLOPS` for analytic chains), then into the device's
    seconds
    and joules; paging costs come from the device's storage figures.
    """
    if chain_flops_per_second <= 0:
        raise InvalidInput("chain_flops_per_second must be positive")
    nodes = _chain_nodes(chain, device, chain_flops_per_second)
    edges, retains = _chain_edges(chain)
    held = _chain_held(chain)
    return TrainingGraph(
        tuple(nodes),
        tuple(edges),
        chain.name or "chain",
        device.name,
        held=tuple(held),
        retains=retains,
    )


def _chain_nodes(chain: Chain, device: EnergyProfile, chain_flops_per_second: float) -> list[Node]:
    """``F0 .. F(L-1)``, ``loss``, ``B(L-1) .. B0`` with their sizes and device costs."""
    n = chain.length

    def node(
        name: str,
        backward: bool,
        seconds: float,
        size: float,
        stage: int,
        peak: float = 0.0,
        paged: float | None = None,
    ) -> Node:
        flop = seconds * chain_flops_per_second
        paged = size if paged is None else paged
        return Node(
            name=name,
            backward=backward,
            compute_seconds=device.compute_seconds(flop),
            compute_joules=device.compute_joules(flop),
            output_bytes=float(size),
            pagein_seconds=device.pagein_seconds(paged),
            pagein_joules=device.pagein_joules(paged),
            pageout_seconds=device.pageout_seconds(paged),
            pageout_joules=device.pageout_joules(paged),
            stage=stage,
            workspace_bytes=max(0.0, float(peak) - size),
        )

    nodes = [
        node(
            f"F{k}:{s.name}",
            False,
            s.forward_seconds,
            s.output_bytes + s.saved_bytes,
            k,
            s.forward_grad_peak_bytes + s.forward_scratch_bytes,
            paged=s.output_bytes,
        )
        for k, s in enumerate(chain.stages)
    ]
    nodes.append(node("loss", True, 0.0, 0.0, -1))
    for k in reversed(range(n)):
        s = chain.stages[k]
        nodes.append(
            node(
                f"B{k}:{s.name}",
                True,
                s.backward_seconds,
                chain.gradient_of_activation_bytes(k),
                k,
                s.backward_peak_bytes + s.backward_scratch_bytes,
            )
        )
    return nodes


def _backward_node(chain: Chain, k: int) -> int:
    """The node id of ``B(k)``: ``B(L-1)`` is node ``L+1``, ``B0`` node ``2L``."""
    return 2 * chain.length - k


def _chain_edges(
    chain: Chain,
) -> tuple[list[tuple[int, int]], tuple[tuple[int, int], ...]]:
    """The edges autograd reads (sorted) and the ``retains`` pairs of stages that save their
    input."""
    n = chain.length
    edges: list[tuple[int, int]] = []
    for k in range(n):
        if k > 0:
            edges.append((k - 1, k))
        edges.append((k, _backward_node(chain, k)))
        if k > 0 and chain.stages[k].saves_input:
            edges.append((k - 1, _backward_node(chain, k)))
        edges.append((n if k == n - 1 else _backward_node(chain, k + 1), _backward_node(chain, k)))
    edges.append((n - 1, n))
    edges.sort()
    retains = tuple((k, k - 1) for k in range(1, n) if chain.stages[k].saves_input)
    return edges, retains


def _chain_held(chain: Chain) -> list[tuple[int, float]]:
    """The output's gradient from the first backward on; the output itself once its forward node
    is gone (the caller keeps it); each backward's parameter gradients after it."""
    n = chain.length
    last = _backward_node(chain, n - 1)
    held = [(last, float(chain.gradient_of_activation_bytes(n)))]
    if last + 1 < 2 * n + 1:
        held.append((last + 1, float(chain.activation_bytes(n))))
    held += [
        (_backward_node(chain, k) + 1, float(chain.stages[k].gradient_bytes))
        for k in range(1, n)
        if chain.stages[k].gradient_bytes
    ]
    return held
