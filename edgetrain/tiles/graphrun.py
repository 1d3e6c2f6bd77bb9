"""One rank running a placed graph model (torch): tiles, halos, gathers, sums over tiles.

A tiled value is this rank's tile of a map (the grid's split of its height and width); a whole
value is the same tensor on every rank. The gradient convention that makes the mixture exact:
the gradient of a tiled value is that of the rank's own tile; the gradient a rank holds of a
whole value is its *share*, and the true gradient is the sum of the shares over the ranks. So

* a window on the whole image slices what its tile reads: the image's gradient is a share;
* an all-gather of tiles (:class:`_Gather`) is adjointed by an all-reduce of the shares and a
  slice of the rank's tile; a sum over tiles (:class:`_Sum`, global average pooling) by an
  all-reduce of the shares;
* the loss of a whole output counts once: rank 0 back-propagates it and the others back-propagate
  zero, so every weight gradient is a share and one all-reduce (sum) of them all is exact. A
  tiled output's loss is a sum over positions: each rank back-propagates its tile's share.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.nn import functional

from edgetrain.tiles.batchnorm import global_batch_norm
from edgetrain.tiles.comm import Comm
from edgetrain.tiles.graph import NONE, SUMMED, TILED, NodeInfo, Placement
from edgetrain.tiles.graphunits import graph_stretches
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.halo import HaloSpec, exchange_halo
from edgetrain.tiles.rankplan import Stretch
from edgetrain.tiles.recompute import batch_norms, recomputed
from edgetrain.tiles.tiled import unpadded_window
from edgetrain.tiles.tiling import Region, Span, region_slices


def tile_region(grid: Grid, rank: int, size: tuple[int, int]) -> Region:
    """``rank``'s tile of a map of ``size`` (height, width)."""
    i, j = grid.position(rank)
    return Region.of(grid.row_spans(size[0])[i], grid.col_spans(size[1])[j])


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tile: torch.Tensor, grid: Grid, size: tuple[int, int], comm: Comm
    ) -> torch.Tensor:  # type: ignore[override]
        rows, cols = grid.row_spans(size[0]), grid.col_spans(size[1])
        tallest, widest = max(b - a for a, b in rows), max(b - a for a, b in cols)
        padded = tile.new_zeros(*tile.shape[:2], tallest, widest)
        padded[:, :, : tile.shape[2], : tile.shape[3]] = tile
        whole = tile.new_empty(*tile.shape[:2], *size)
        for rank, part in enumerate(comm.gather_small(padded)):
            region = tile_region(grid, rank, size)
            whole[region_slices(region)] = part[:, :, : region.height, : region.width]
        ctx.region, ctx.comm = tile_region(grid, comm.rank, size), comm
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        total = ctx.comm.all_reduce_(grad.contiguous().clone())
        return total[region_slices(ctx.region)].contiguous(), None, None, None


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, share: torch.Tensor, comm: Comm) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return comm.all_reduce_(share.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return ctx.comm.all_reduce_(grad.contiguous().clone()), None


def _clip(rows: Span, cols: Span, size: tuple[int, int]) -> Region:
    return Region(max(rows[0], 0), min(rows[1], size[0]), max(cols[0], 0), min(cols[1], size[1]))


def halo_spec(
    rank: int,
    grid: Grid,
    size: tuple[int, int],
    needs: tuple[tuple[Span, ...], tuple[Span, ...]],
    fill: float,
    tag: int,
) -> HaloSpec:
    """The exchange at a tiled window's input of ``size``: grid row ``i`` and column ``j`` read
    rows ``needs[0][i]`` x columns ``needs[1][j]`` (unclipped: beyond the map is ``fill``)."""
    i, j = grid.position(rank)
    (top, bottom), (left, right) = needs[0][i], needs[1][j]
    clipped = _clip(needs[0][i], needs[1][j], size)
    padded = Region(top, bottom, left, right)
    tile = tile_region(grid, rank, size)
    height, width = bottom - top, right - left
    pads = (clipped.top - top, bottom - clipped.bottom, clipped.left - left, right - clipped.right)
    strips = (
        Region(0, pads[0], 0, width),
        Region(height - pads[1], height, 0, width),
        Region(pads[0], height - pads[1], 0, pads[2]),
        Region(pads[0], height - pads[1], width - pads[3], width),
    )
    sends, receives = [], []
    for peer in range(grid.size):
        if peer == rank:
            continue
        got = clipped.intersect(tile_region(grid, peer, size))
        if not got.empty:
            receives.append((peer, got.relative_to(padded)))
        pi, pj = grid.position(peer)
        given = _clip(needs[0][pi], needs[1][pj], size).intersect(tile)
        if not given.empty:
            sends.append((peer, given.relative_to(tile)))
    keep = clipped.intersect(tile)
    return HaloSpec(
        shape=(height, width),
        tile_shape=(tile.height, tile.width),
        keep_from=keep.relative_to(tile),
        keep_to=keep.relative_to(padded),
        sends=tuple(sends),
        receives=tuple(receives),
        borders=tuple(r for r in strips if not r.empty),
        fill=fill,
        tag=tag,
    )


class TiledGraph:
    """Runs a captured model as ``placement`` says on rank ``comm.rank``."""

    def __init__(
        self,
        graph: fx.GraphModule,
        infos: tuple[NodeInfo, ...],
        placement: Placement,
        comm: Comm,
        recompute: frozenset[int] = frozenset(),
    ) -> None:
        self.graph, self.placement, self.comm = graph, placement, comm
        self.nodes = tuple(graph.graph.nodes)
        self.recompute = {  # first operation -> the stretch run again in backward
            s.start: s for s in graph_stretches(graph, infos, placement) if s.start in recompute
        }
        self.norms = batch_norms(graph)
        self.grid = placement.grid
        self.infos = {i.node.name: i for i in infos}
        self.modules = dict(graph.named_modules())
        self.specs: dict[str, HaloSpec] = {}
        for tag, (name, (rows, cols)) in enumerate(placement.window_needs.items()):
            self.specs[name] = self._spec(name, rows, cols, tag + 1)

    def _size(self, name: str) -> tuple[int, int]:
        shape = self.infos[name].shape
        assert shape is not None and len(shape) == 4
        return shape[2], shape[3]

    def _spec(
        self, name: str, rows: tuple[Span, ...], cols: tuple[Span, ...], tag: int
    ) -> HaloSpec:
        node = self.infos[name].node
        size = self._size(node.all_input_nodes[0].name)
        module = self.modules[str(node.target)]
        fill = float("-inf") if isinstance(module, nn.MaxPool2d) else 0.0
        return halo_spec(self.comm.rank, self.grid, size, (rows, cols), fill, tag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` is the whole input; returns the output (this rank's tile when it is tiled)."""
        env: dict[str, Any] = {}
        position = 0
        while position < len(self.nodes):
            node = self.nodes[position]
            if node.op == "placeholder":
                env[node.name] = x
            elif node.op == "output":
                return self._load(node.args[0], env, node.name)  # type: ignore[no-any-return]
            elif position in self.recompute:
                stretch = self.recompute[position]
                env[stretch.result] = recomputed(
                    self._stretch, stretch, env[stretch.source], norms=self.norms
                )
                position = stretch.stop
                continue
            else:
                env[node.name] = self._value(node, env)
            position += 1
        raise AssertionError("graph without output")

    def _stretch(self, stretch: Stretch, source: torch.Tensor) -> Any:
        """The result of ``stretch`` run on ``source`` alone (nothing else it reads is live)."""
        env: dict[str, Any] = {stretch.source: source}
        for node in self.nodes[stretch.start : stretch.stop]:
            env[node.name] = self._value(node, env)
        return env[stretch.result]

    def _value(self, node: fx.Node, env: dict[str, Any]) -> Any:
        name = node.name
        placed = self.placement.where[name]
        if placed == TILED and name in self.specs:
            return self._window(node, env)
        if placed == TILED:
            return self._tiled(node, env)
        if placed == SUMMED:
            return self._summed(node, env)
        if placed == NONE and any(
            self.placement.where.get(a.name) == TILED for a in node.all_input_nodes
        ):
            return self._on_meta(node, env)
        return self._run(node, self._args(node, env, name))

    __call__ = forward

    def _load(self, value: Any, env: dict[str, Any], user: str) -> Any:
        """Replace nodes in ``value`` by their values, gathering tiles ``user`` needs whole."""
        gathers = self.placement.gathers.get(user, ())

        def load(n: fx.Node) -> Any:
            if n.name in gathers:
                return _Gather.apply(env[n.name], self.grid, self._size(n.name), self.comm)
            return env[n.name]

        return fx.node.map_arg(value, load)

    def _args(self, node: fx.Node, env: dict[str, Any], user: str) -> tuple[tuple, dict]:
        return self._load(node.args, env, user), self._load(node.kwargs, env, user)

    def _run(self, node: fx.Node, loaded: tuple[tuple, dict]) -> Any:
        args, kwargs = loaded
        if node.op == "call_module":
            return self.modules[str(node.target)](*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)  # type: ignore[operator]
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        if node.op == "get_attr":
            value: Any = self.graph
            for part in str(node.target).split("."):
                value = getattr(value, part)
            return value
        raise AssertionError(f"unexpected node {node.op}")

    def _window(self, node: fx.Node, env: dict[str, Any]) -> torch.Tensor:
        module = self.modules[str(node.target)]
        source = node.all_input_nodes[0]
        spec = self.specs[node.name]
        if self.placement.where[source.name] == TILED:
            x = exchange_halo(env[source.name], spec, self.comm)
        else:  # the whole map (the image): slice what the tile reads, pad beyond the borders
            size = self._size(source.name)
            i, j = self.grid.position(self.comm.rank)
            rows, cols = self.placement.window_needs[node.name]
            (top, bottom), (left, right) = rows[i], cols[j]
            x = env[source.name][
                :, :, max(top, 0) : min(bottom, size[0]), max(left, 0) : min(right, size[1])
            ]
            pads = (max(0, -left), max(0, right - size[1]), max(0, -top), max(0, bottom - size[0]))
            if any(pads):
                x = functional.pad(x, pads, value=spec.fill)
        if isinstance(module, nn.ConvTranspose2d):
            return self._transposed(node, module, x)
        return unpadded_window(module, x)

    def _transposed(
        self, node: fx.Node, module: nn.ConvTranspose2d, x: torch.Tensor
    ) -> torch.Tensor:
        y = functional.conv_transpose2d(
            x, module.weight, None, module.stride, 0, 0, module.groups, module.dilation
        )
        i, j = self.grid.position(self.comm.rank)
        rows, cols = self.placement.window_needs[node.name]
        out = tile_region(self.grid, self.comm.rank, self._size(node.name))
        # y's first row is output row rows[i][0] * stride - padding
        top = rows[i][0] * module.stride[0] - module.padding[0]
        left = cols[j][0] * module.stride[1] - module.padding[1]
        y = y[:, :, out.top - top : out.bottom - top, out.left - left : out.right - left]
        if module.bias is not None:
            y = y + module.bias.view(1, -1, 1, 1)
        return y

    def _tiled(self, node: fx.Node, env: dict[str, Any]) -> Any:
        size = self._size(node.name)
        region = tile_region(self.grid, self.comm.rank, size)

        def local(n: fx.Node) -> Any:
            value = env[n.name]
            if self.placement.where[n.name] == TILED:
                return value
            shape = self.infos[n.name].shape
            if (
                shape is not None
                and len(shape) >= 2
                and tuple(shape[-2:]) == size
                and size != (1, 1)
            ):
                return value[..., region.top : region.bottom, region.left : region.right]
            return value

        args = fx.node.map_arg(node.args, local)
        kwargs = fx.node.map_arg(node.kwargs, local)
        module = self.modules.get(str(node.target)) if node.op == "call_module" else None
        if isinstance(module, nn.BatchNorm2d):
            return global_batch_norm(args[0], module, (slice(None), slice(None)), self.comm)
        return self._run(node, (args, kwargs))

    def _summed(self, node: fx.Node, env: dict[str, Any]) -> torch.Tensor:
        source = node.all_input_nodes[0].name
        height, width = self._size(source)
        share = env[source].sum(dim=(2, 3), keepdim=True) / (height * width)
        shape = self.infos[node.name].shape
        assert shape is not None
        return _Sum.apply(share, self.comm).reshape(shape[0], *shape[1:])  # type: ignore[no-any-return]

    def _on_meta(self, node: fx.Node, env: dict[str, Any]) -> Any:
        """A size query of a tiled map answered for the whole map."""

        def meta(n: fx.Node) -> Any:
            if self.placement.where.get(n.name) == TILED:
                shape = self.infos[n.name].shape
                assert shape is not None
                return torch.empty(shape, device="meta", dtype=env[n.name].dtype)
            return env[n.name]

        return self._run(
            node, (fx.node.map_arg(node.args, meta), fx.node.map_arg(node.kwargs, meta))
        )
