"""A training step of a graph model on tiles, or on one process as its reference (torch).

The loss is the model's own kind of loss: cross-entropy for a model that ends in class scores
(``N, K``; the labels are the argmax of a synthetic target), the mean squared error for one that
ends in maps. A tiled output's loss is a sum over positions, so each rank computes its tile's
share and an all-reduce adds the shares; a whole output's loss is the same on every rank and
counts once (rank 0 back-propagates it, see :mod:`edgetrain.tiles.graphrun`). Dropout in the
whole part draws the same mask on every rank and in the reference: each step seeds torch's
generator the same way before the forward pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional

from edgetrain.errors import InvalidInput
from edgetrain.tiles.comm import Comm
from edgetrain.tiles.graph import TILED, analyse, place
from edgetrain.tiles.graphrun import TiledGraph, tile_region
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.sync import LossTotal
from edgetrain.tiles.tiling import Region


class GraphStep:
    """Forward and loss of ``model`` on rank ``comm.rank`` of ``grid`` with the front cut at
    ``cut`` (``reference``: the whole model in this process)."""

    def __init__(
        self,
        model: nn.Module,
        sample: torch.Tensor,
        grid: Grid,
        cut: int,
        comm: Comm,
        reference: bool = False,
        recompute: frozenset[int] = frozenset(),
    ) -> None:
        graph, infos = analyse(model, sample)
        self.comm, self.reference = comm, reference
        output = next(i for i in infos if i.node.op == "output")
        returned = output.node.args[0]
        last = next((i for i in infos if i.node is returned), None)
        if last is None or last.shape is None or len(last.shape) not in (2, 4):
            raise InvalidInput(
                "tiles train a model that returns one tensor of class scores (N, K) or of maps "
                "(N, C, H, W); return one of those from forward()"
            )
        self.out_shape = tuple(last.shape)
        height, width = sample.shape[2], sample.shape[3]
        self.input_region = Region(0, height, 0, width)
        if reference:
            self.model: nn.Module | TiledGraph = model
            self.tiled_output = False
        else:
            placement = place(graph, infos, grid, cut)
            self.model = TiledGraph(graph, infos, placement, comm, recompute)
            self.tiled_output = placement.where[output.node.name] == TILED
        if self.tiled_output:
            self.output_region = tile_region(grid, comm.rank, self.out_shape[2:])  # type: ignore[arg-type]
        elif len(self.out_shape) == 4:
            self.output_region = Region(0, self.out_shape[2], 0, self.out_shape[3])
        else:
            self.output_region = Region(0, 0, 0, 0)

    def forward(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return self.model(x)  # type: ignore[no-any-return]

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, LossTotal]:
        """The loss to back-propagate on this rank, and the batch's loss."""
        if len(self.out_shape) == 2:
            value = functional.cross_entropy(out, target.argmax(dim=1))
        elif self.tiled_output:
            r = self.output_region
            share = (out - target[:, :, r.top : r.bottom, r.left : r.right]).square().sum()
            share = share / target.numel()
            return share, LossTotal.summed(share, self.comm)
        else:
            value = (out - target).square().sum() / target.numel()
        counted = value if self.reference or self.comm.rank == 0 else value * 0.0
        return counted, LossTotal(value.detach())


def load_file_model(spec: str, state: dict[str, torch.Tensor]) -> nn.Module:
    """A user's model (``FILE.py:FUNCTION``, an absolute path) rebuilt with the given weights:
    in a worker, from the launcher's; in the launcher, as a copy. It travels as the file's too."""
    from edgetrain.models.factory import load_model_file

    model = load_model_file(spec).model
    model.load_state_dict(state)
    _travel_as_file(model, spec)
    return model


def ship_file_model(model: nn.Module, spec: str) -> None:
    """Let ``model``, built from ``spec``, travel to workers: its classes live in a module only
    this process imported, so it pickles (and copies) as the spec and its weights, rebuilt
    there. Only this instance and its copies do: other models of the same class (a bare
    ``nn.Sequential``) pickle as they always do."""
    from pathlib import Path

    path, _, function = spec.rpartition(":")
    _travel_as_file(model, f"{Path(path).resolve()}:{function}")


def _travel_as_file(model: nn.Module, spec: str) -> None:
    def reduce(protocol: int) -> tuple[Any, tuple[str, dict[str, torch.Tensor]]]:
        return load_file_model, (spec, model.state_dict())

    # An instance attribute: pickle and copy look ``__reduce_ex__`` up on the object.
    model.__dict__["__reduce_ex__"] = reduce
