"""The run of a traced graph on the sample that records, per node, its output's shape, dtype and
bytes, what it overwrites in place and what it aliases.

The run happens under ``torch.no_grad()`` with the RNG state and every buffer restored
afterwards, so capturing leaves the model exactly as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from edgetrain.autograd.storage_counter import storage_key
from edgetrain.errors import InvalidInput
from edgetrain.frontend.captured import KINDS, value_inputs
from edgetrain.frontend.model_state import restored

Record = tuple[Any, tuple[str, ...], str | None]


class _Recorder(fx.Interpreter):
    """Runs the graph and notes, per node, its output, what it overwrote, what it aliases."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.records: dict[fx.Node, Record] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in KINDS:
            return super().run_node(n)
        reads = [(a.name, self.env[a]) for a in value_inputs(n)]
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


def record_nodes(
    model: nn.Module, graph_module: fx.GraphModule, samples: tuple[torch.Tensor, ...]
) -> dict[fx.Node, Record]:
    recorder = _Recorder(graph_module)
    with restored(model), torch.no_grad():
        try:
            recorder.run(*(s.detach() for s in samples))
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidInput(
                f"{type(model).__name__} does not run on the sample "
                f"{[tuple(s.shape) for s in samples]}: {first}; give an input the model accepts"
            ) from exc
    return recorder.records
