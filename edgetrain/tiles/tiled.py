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

from edgetrain.tiles.batchnorm import global_batch_norm, global_statistics
from edgetrain.tiles.comm import Comm
from edgetrain.tiles.halo import HaloSpec, exchange_halo
from edgetrain.tiles.halonorm import halo_batch_norm
from edgetrain.tiles.layers import model_ops
from edgetrain.tiles.recompute import batch_norms, recomputed
from edgetrain.tiles.tiling import GroupPlan, Region, TilePlan, region_slices


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
        self.bare_halos = tuple(
            HaloSpec.of(g, self.rank, i, padded=False) for i, g in enumerate(plan.groups)
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
        groups = self.plan.groups
        assembled = False  # the region the group reads came with the last batch norm
        for index, group in enumerate(groups):
            if index > 0 and not assembled:
                x = exchange_halo(x, self.halos[index], self.comm)
            for step, layer in enumerate(group.layers):
                padded = index > 0 and step == 0
                last = step == len(group.layers) - 1 and index + 1 < len(groups)
                following = index + 1 if last else None
                # A batch norm that carries the next group's halo exchanges with the other
                # ranks: its layer runs once, never recomputed.
                carries = following is not None and self._merged(layer) is not None
                if layer in self.recompute and not carries:
                    x = recomputed(
                        self._recomputed_layer, x, group, step, layer, padded, norms=self.norms
                    )
                    assembled = False
                else:
                    x, assembled = self._layer(x, group, step, layer, padded, following)
        return x

    __call__ = forward

    def _recomputed_layer(
        self, x: torch.Tensor, group: GroupPlan, step: int, layer: int, padded: bool
    ) -> torch.Tensor:
        """:meth:`_layer` for a layer a rank recomputes (it exchanges no halo)."""
        return self._layer(x, group, step, layer, padded, None)[0]

    def _merged(self, layer: int) -> int | None:
        """Which of ``layer``'s element-wise ops is the batch norm whose statistics travel with
        the next group's halo (its last one with batch statistics), if any."""
        found = None
        for position, op in enumerate(self.ops[layer].after):
            if isinstance(op, nn.BatchNorm2d) and global_statistics(op):
                found = position
        return found

    def _layer(
        self,
        x: torch.Tensor,
        group: GroupPlan,
        step: int,
        layer: int,
        padded: bool,
        following: int | None,
    ) -> tuple[torch.Tensor, bool]:
        """One layer on the local region; at a group's end (``following``: the next group's
        index) its last batch norm exchanges the next group's halo, and the result is that
        group's padded input region (then True)."""
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
        rows, cols = region_slices(owned)[2:]
        merged = self._merged(layer) if following is not None else None
        for position, op in enumerate(ops.after):
            if position == merged:
                assert following is not None
                x = halo_batch_norm(x, op, (rows, cols), self.bare_halos[following], self.comm)
            elif isinstance(op, nn.BatchNorm2d):
                x = global_batch_norm(x, op, (rows, cols), self.comm)
            else:
                x = op(x)
        if merged is None or following is None:
            return x, False
        nxt = self.plan.groups[following]
        pads = nxt.pads(0, self.rank)
        if any(pads):
            x = functional.pad(x, pads, value=self._fill(nxt.first))
        return x, True
