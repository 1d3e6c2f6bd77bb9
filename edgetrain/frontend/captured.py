"""A captured graph: its operations in the order ``forward()`` runs them (:class:`Captured`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

KINDS = {"call_module": "module", "call_function": "function", "call_method": "method"}


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
    """A model traced by :func:`~edgetrain.frontend.fx_capture.capture`.

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


def value_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if a.op == "placeholder" or a.op in KINDS]
