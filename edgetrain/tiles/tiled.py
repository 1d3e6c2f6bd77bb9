"""One rank's share of a network: its tile through every fused group (torch).

Per group: the halo exchange assembles the region the rank needs of the group input (the first
group reads it straight from the data), then each layer runs on the local region with its
padding applied only where the region touches the true image border (zeros for convolutions and
average pooling, -inf for max pooling, as torch pads them; the exchange writes the first layer's
padding as it assembles) and the layer's own padding set to zero. A rank may also hold rows its
next window does not read (rows a floor-mode window drops at the end of a map, or rows a stride
skips): it computes them because it owns them and batch norm counts them, and crops them off
before the window. Batch norm uses the statistics of the whole map
(:mod:`edgetrain.tiles.batchnorm`). The result is the rank's tile of the last layer's
output. Autograd records all of it, halo exchanges included, so one ``backward()`` runs the
groups in reverse with gradient halos.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from edgetrain.tiles.batchnorm import global_batch_norm
from edgetrain.tiles.comm import Comm
from edgetrain.tiles.halo import HaloSpec, exchange_halo
from edgetrain.tiles.layers import model_ops
from edgetrain.tiles.recompute import batch_norms, recomputed
from edgetrain.tiles.tiling import GroupPlan, Region, TilePlan


def region_slices(region: Region) -> tuple[slice, slice, slice, slice]:
    """Index an ``N, C, H, W`` tensor by ``region``."""
    rows, cols = slice(region.top, region.bottom), slice(region.left, region.right)
    return (slice(None), slice(None), rows, cols)


def unpadded_window(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module`` (a convolution or pooling window) on ``x`` without its padding: a tile's
    halo (or the border's fill) is already around ``x``."""
    if isinstance(module, nn.Conv2d):
        return functional.conv2d(
            x, module.weight, module.bias, module.stride, 0, module.dilation, module.groups
        )
    if isinstance(module, nn.MaxPool2d):
        return functional.max_pool2d(x, module.kernel_size, module.stride, 0, module.dilation)
    if isinstance(module, nn.AvgPool2d):
        return functional.avg_pool2d(x, module.kernel_size, module.stride, 0)
    raise AssertionError(f"not a window: {module}")


class TiledNetwork:
    """Runs ``model`` as ``plan`` says on rank ``comm.rank`` (weights shared with ``model``)."""

    def __init__(
        self,
        model: nn.Sequential,
        plan: TilePlan,
        comm: Comm,
        recompute: frozenset[int] = frozenset(),
    ) -> None:
        if comm.size != plan.ranks:
            raise AssertionError(f"{comm.size} ranks for a {plan.grid} grid")
        self.model = model
        self.plan = plan
        self.comm = comm
        self.rank = comm.rank
        self.ops = model_ops(model)
        self.recompute = recompute  # layers kept as their input only, run again in backward
        self.norms = batch_norms(model)
        self.halos = tuple(
            HaloSpec.of(g, self.rank, i, self._fill(g.first)) for i, g in enumerate(plan.groups)
        )

    def _fill(self, layer: int) -> float:
        """The padding value of ``layer``'s window: -inf for max pooling, else 0."""
        return float("-inf") if isinstance(self.ops[layer].window, nn.MaxPool2d) else 0.0

    @property
    def input_region(self) -> Region:
        """The region of the image this rank reads."""
        return self.plan.groups[0].input(self.rank)

    @property
    def output_region(self) -> Region:
        """This rank's tile of the network output."""
        return self.plan.groups[-1].tile(self.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` is the image over :attr:`input_region`; returns the tile :attr:`output_region`."""
        for index, group in enumerate(self.plan.groups):
            if index > 0:
                x = exchange_halo(x, self.halos[index], self.comm)
            for step, layer in enumerate(group.layers):
                padded = index > 0 and step == 0
                if layer in self.recompute:
                    x = recomputed(self._layer, x, group, step, layer, padded, norms=self.norms)
                else:
                    x = self._layer(x, group, step, layer, padded)
        return x

    __call__ = forward

    def _layer(
        self, x: torch.Tensor, group: GroupPlan, step: int, layer: int, padded: bool
    ) -> torch.Tensor:
        ops = self.ops[layer]
        if ops.window is not None:
            held, read = group.computed(step, self.rank), group.needed(step, self.rank)
            if read != held:  # rows it computed only for batch norm, which feed no window
                x = x[region_slices(read.relative_to(held))]
            pads = group.pads(step, self.rank)
            if any(pads) and not padded:  # a halo exchange pads while it assembles
                x = functional.pad(x, pads, value=self._fill(layer))
            x = unpadded_window(ops.window, x)
        owned = group.owned(step + 1, self.rank).relative_to(group.computed(step + 1, self.rank))
        owned_slices = region_slices(owned)[2:]
        for op in ops.after:
            if isinstance(op, nn.BatchNorm2d):
                x = global_batch_norm(x, op, (owned_slices[0], owned_slices[1]), self.comm)
            else:
                x = op(x)
        return x
