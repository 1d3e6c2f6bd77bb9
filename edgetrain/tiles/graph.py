"""Any CNN torch.fx captures, placed on tiles: which operations run tiled, where the front ends.

The model is captured with ``torch.fx.symbolic_trace`` and its shapes found by running it once
(a copy, in eval mode, without gradients). Each operation gets a *placement* for a *cut* (an
index into the graph's operations):

* before the cut, a window (``Conv2d``, ``MaxPool2d``, ``AvgPool2d``, ``ConvTranspose2d``) on a
  tiled map or on the image runs on tiles with a halo exchange, when its output has at least one
  pixel per grid row and column; batch norm, element-wise operations, additions and channel
  concatenations of tiled maps of one size run tile by tile;
* global average pooling (``adaptive_avg_pool2d(x, 1)``, ``x.mean((2, 3))``) of a tiled map is
  a sum over tiles and an all-reduce;
* anything else that meets a tiled map (a flatten, a Linear layer, an operation past the cut)
  gets it whole: the tiles are all-gathered, and it runs on every rank.

:func:`choose_cut` prices every cut with :func:`~edgetrain.tiles.front.front_cost` and keeps the
cheapest: far enough to share the feature-map-heavy front, not so far that small maps cost
more in halos and statistics than they save.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn import functional

from edgetrain.devices.cluster import Cluster
from edgetrain.errors import InvalidInput
from edgetrain.tiles.front import (
    FrontCost,
    FrontOp,
    front_cost,
    transposed_needed,
    window_transfers,
)
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.layers import ELEMENTWISE
from edgetrain.tiles.tiling import Span, Window

TILED, REPLICATED, SUMMED, NONE = "tiled", "replicated", "summed", "none"

_POINTWISE_FUNCTIONS: set[Any] = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.iadd,
    operator.imul,
    torch.add,
    torch.sub,
    torch.mul,
    torch.relu,
    torch.sigmoid,
    torch.tanh,
    functional.relu,
    functional.relu6,
    functional.leaky_relu,
    functional.hardtanh,
    functional.hardswish,
    functional.hardsigmoid,
    functional.silu,
    functional.gelu,
    functional.elu,
    functional.mish,
}
_POINTWISE_METHODS = {
    "add",
    "add_",
    "sub",
    "mul",
    "mul_",
    "div",
    "relu",
    "relu_",
    "sigmoid",
    "tanh",
    "contiguous",
    "clone",
}
_SIZE_METHODS = {"size", "dim"}


@dataclass(frozen=True)
class NodeInfo:
    """One graph node as tiling sees it: its kind, its output shape and its forward work."""

    node: fx.Node
    kind: str
    """``window``, ``transposed``, ``batchnorm``, ``pointwise``, ``cat``, ``mean``, ``size``,
    ``input``, ``output``, ``other``."""
    shape: tuple[int, ...] | None
    macs: int
    element_bytes: int


def capture(model: nn.Module) -> fx.GraphModule:
    """``model`` as an fx graph (its parameters and buffers shared); InvalidInput if fx cannot."""
    try:
        return fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many kinds on data-dependent control flow
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise InvalidInput(
            f"torch.fx cannot capture {type(model).__name__} ({line}); tiles need a model "
            "without data-dependent control flow in forward()"
        ) from None


def _plain_window(module: nn.Module) -> bool:
    """A transposed convolution without output padding, or a floor-mode max pooling."""
    if isinstance(module, nn.ConvTranspose2d):
        return not any(module.output_padding)
    return isinstance(module, nn.MaxPool2d) and not module.ceil_mode and not module.return_indices


def _window_of(module: nn.Module) -> tuple[Window, Window] | None:
    if isinstance(module, nn.Conv2d) and module.padding_mode == "zeros":
        if isinstance(module.padding, str):
            return None
        k, s, p, d = module.kernel_size, module.stride, module.padding, module.dilation
    elif _plain_window(module):
        k, s, p, d = module.kernel_size, module.stride, module.padding, module.dilation
    elif (
        isinstance(module, nn.AvgPool2d)
        and not module.ceil_mode
        and module.count_include_pad
        and module.divisor_override is None
    ):
        k, s, p, d = module.kernel_size, module.stride, module.padding, 1
    else:
        return None

    def pair(v: Any) -> tuple[int, int]:
        return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))

    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = pair(k), pair(s or k), pair(p), pair(d)
    return Window(kh, sh, ph, dh), Window(kw, sw, pw, dw)


def _is_global_mean(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        module = modules[str(node.target)]
        return isinstance(module, nn.AdaptiveAvgPool2d) and module.output_size in (1, (1, 1))
    if node.op == "call_function" and node.target is functional.adaptive_avg_pool2d:
        size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
        return size in (1, (1, 1))
    is_mean = (node.op == "call_function" and node.target is torch.mean) or (
        node.op == "call_method" and node.target == "mean"
    )
    if not is_mean:
        return False
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return isinstance(dims, (tuple, list)) and sorted(int(d) % 4 for d in dims) == [2, 3]


def _kind(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    if node.op in ("placeholder", "get_attr"):
        return "input"
    if node.op == "output":
        return "output"
    if _is_global_mean(node, modules):
        return "mean"
    if node.op == "call_module":
        module = modules[str(node.target)]
        if _window_of(module) is not None:
            return "transposed" if isinstance(module, nn.ConvTranspose2d) else "window"
        if isinstance(module, nn.BatchNorm2d):
            return "batchnorm"
        if isinstance(module, ELEMENTWISE) or (isinstance(module, nn.Dropout) and module.p == 0):
            return "pointwise"
        return "other"
    if node.op == "call_function":
        if node.target in _POINTWISE_FUNCTIONS:
            return "pointwise"
        if node.target is torch.cat:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            return "cat" if dim in (1, -3) else "other"
        if node.target is getattr and node.args[1] in ("shape", "ndim", "dtype", "device"):
            return "size"
        return "other"
    if node.target in _POINTWISE_METHODS:
        return "pointwise"
    return "size" if node.target in _SIZE_METHODS else "other"


def _macs(node: fx.Node, kind: str, shape: tuple[int, ...] | None, modules: dict) -> int:
    if shape is None:
        return 0
    elements = 1
    for s in shape:
        elements *= s
    if node.op == "call_module":
        module = modules[str(node.target)]
        if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
            k = module.kernel_size[0] * module.kernel_size[1]
            fan = module.in_channels if isinstance(module, nn.Conv2d) else module.out_channels
            if isinstance(module, nn.ConvTranspose2d):  # every input pixel writes a window
                return (
                    elements
                    * module.in_channels
                    * k
                    // (module.groups * max(1, module.stride[0] * module.stride[1]))
                )
            return elements * fan // module.groups * k
        if isinstance(module, nn.Linear):
            return elements * module.in_features
        if kind == "window":
            window = _window_of(module)
            assert window is not None
            return elements * window[0].kernel * window[1].kernel
    return elements


def analyse(model: nn.Module, sample: torch.Tensor) -> tuple[fx.GraphModule, tuple[NodeInfo, ...]]:
    """Capture ``model`` and describe every node for a ``sample`` input (full batch and size)."""
    graph = capture(model)
    probe = copy.deepcopy(graph).eval()
    try:
        with torch.no_grad():
            ShapeProp(probe).propagate(sample)
    except Exception as exc:  # the model refuses this input (too small, wrong channels)
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        raise InvalidInput(
            f"the model cannot take an input of shape {tuple(sample.shape)} ({line}); "
            "give an image size and batch it accepts"
        ) from None
    modules = dict(graph.named_modules())
    infos = []
    for node, probed in zip(graph.graph.nodes, probe.graph.nodes, strict=True):
        meta = probed.meta.get("tensor_meta")
        shape = tuple(meta.shape) if hasattr(meta, "shape") else None
        element = meta.dtype.itemsize if hasattr(meta, "dtype") else 0
        kind = _kind(node, modules)
        infos.append(NodeInfo(node, kind, shape, _macs(node, kind, shape, modules), element))
    return graph, tuple(infos)


def _map(info: NodeInfo | None) -> tuple[int, int] | None:
    """``(height, width)`` when the node's output is an ``N, C, H, W`` map."""
    if info is None or info.shape is None or len(info.shape) != 4:
        return None
    return info.shape[2], info.shape[3]


@dataclass(frozen=True)
class Placement:
    """Where each node runs for one cut: per node name, its placement and the tiled inputs it
    gathers whole (by name)."""

    cut: int
    grid: Grid
    where: dict[str, str]
    gathers: dict[str, tuple[str, ...]]
    window_needs: dict[str, tuple[tuple[Span, ...], tuple[Span, ...]]]
    """Per tiled window: the input span each grid row and column reads, unclipped for a window
    (padding beyond the map), clipped for a transposed convolution."""


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes]


def _needs(module: nn.Module, kind: str, size: tuple[int, int], out: tuple[int, int], grid: Grid):
    window = _window_of(module)
    assert window is not None
    spans = []
    for axis, cut in ((0, grid.row_spans), (1, grid.col_spans)):
        tiles = cut(out[axis])
        if kind == "transposed":
            spans.append(tuple(transposed_needed(t, window[axis], size[axis]) for t in tiles))
        else:
            spans.append(tuple(window[axis].needed(t) for t in tiles))
    return spans[0], spans[1]


def place(graph: fx.GraphModule, infos: tuple[NodeInfo, ...], grid: Grid, cut: int) -> Placement:
    """Place every node for ``cut`` (see the module docstring)."""
    modules = dict(graph.named_modules())
    by_name = {i.node.name: i for i in infos}
    where: dict[str, str] = {}
    gathers: dict[str, tuple[str, ...]] = {}
    needs: dict[str, Any] = {}
    for index, info in enumerate(infos):
        node = info.node
        inputs = _tensor_inputs(node)
        tiled = [a for a in inputs if where.get(a.name) == TILED]
        size = _map(info)
        fits = size is not None and size[0] >= grid.rows and size[1] >= grid.cols
        placed = REPLICATED
        if info.kind in ("input", "size"):
            placed = NONE if info.kind == "size" else REPLICATED
        elif info.kind == "output":
            placed = (
                TILED
                if tiled and len(inputs) == 1 and isinstance(node.args[0], fx.Node)
                else REPLICATED
            )
        elif index < cut and fits and info.kind in ("window", "transposed"):
            source = inputs[0] if inputs else None
            if source is not None and (_map(by_name[source.name]) is not None):
                placed = TILED
                module = modules[str(node.target)]
                needs[node.name] = _needs(module, info.kind, _map(by_name[source.name]), size, grid)
        elif tiled and index < cut and info.kind == "mean":
            placed = SUMMED
        elif tiled and index < cut and info.kind in ("batchnorm", "pointwise", "cat") and fits:
            aligned = all(
                where.get(a.name) == TILED
                or (by_name[a.name].shape is not None and _broadcasts(by_name[a.name].shape, size))
                for a in inputs
            )
            placed = TILED if aligned else REPLICATED
        if placed in (REPLICATED,) and tiled and info.kind != "size":
            gathers[node.name] = tuple(a.name for a in tiled)
        where[node.name] = placed
    return Placement(cut, grid, where, gathers, needs)


def _broadcasts(shape: tuple[int, ...], size: tuple[int, int]) -> bool:
    """Whether a whole tensor of ``shape`` meets a tiled map of ``size`` element-wise: it has no
    spatial extent (per channel) or is a whole map of the same size (each rank slices its tile)."""
    if len(shape) < 2:
        return True
    return tuple(shape[-2:]) in ((1, 1), size)


def front_ops(infos: tuple[NodeInfo, ...], placement: Placement) -> tuple[FrontOp, ...]:
    """The cost model's view of ``placement``."""
    grid = placement.grid
    by_name = {i.node.name: i for i in infos}
    ops = []
    for info in infos:
        name = info.node.name
        placed = placement.where[name]
        size = _map(info)
        fractions: tuple[float, ...] = ()
        transfers: tuple = ()
        transfer_bytes: tuple[int, ...] = ()
        if placed == TILED and size is not None:
            rows, cols = grid.row_spans(size[0]), grid.col_spans(size[1])
            fractions = tuple(
                (rows[i][1] - rows[i][0]) * (cols[j][1] - cols[j][0]) / (size[0] * size[1])
                for i, j in map(grid.position, range(grid.size))
            )
            if name in placement.window_needs:
                source = by_name[info.node.all_input_nodes[0].name]
                in_size = _map(source)
                assert in_size is not None and source.shape is not None
                need_r, need_c = placement.window_needs[name]
                transfers = (
                    window_transfers(grid, in_size, need_r, need_c)
                    if placement.where[source.node.name] == TILED
                    else ()
                )
                per_pixel = source.shape[0] * source.shape[1] * source.element_bytes
                transfer_bytes = tuple(t.region.area * per_pixel for t in transfers)
        gathered = sum(_bytes(by_name[g]) for g in placement.gathers.get(name, ()))
        summed = _bytes(info) if placed == SUMMED else 0
        bn = 0
        if placed == TILED and info.kind == "batchnorm" and info.shape is not None:
            bn = info.shape[1] * info.element_bytes
        macs = 0 if placed == NONE else info.macs
        ops.append(
            FrontOp(name, placed, macs, fractions, transfers, transfer_bytes, gathered, summed, bn)
        )
    return tuple(ops)


def _bytes(info: NodeInfo) -> int:
    if info.shape is None:
        return 0
    total = info.element_bytes
    for s in info.shape:
        total *= s
    return total


def gradient_bytes(model: nn.Module) -> tuple[int, ...]:
    """Bytes of each trainable parameter's gradient, the last registered first: the units the
    weight-gradient all-reduce buckets for a captured model."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    return tuple(p.numel() * p.element_size() for p in reversed(parameters))


def choose_cut(
    graph: fx.GraphModule, infos: tuple[NodeInfo, ...], grid: Grid, cluster: Cluster
) -> tuple[Placement, FrontCost]:
    """The cheapest cut on ``grid`` by :func:`~edgetrain.tiles.front.front_cost`, among cuts
    whose front holds at least one window; InvalidInput when no window fits the grid."""
    parameter_bytes = gradient_bytes(graph)
    best: tuple[Placement, FrontCost] | None = None
    for cut in range(1, len(infos) + 1):
        placement = place(graph, infos, grid, cut)
        if not placement.window_needs:
            continue
        cost = front_cost(cut, front_ops(infos, placement), parameter_bytes, grid, cluster)
        if best is None or cost.seconds < best[1].seconds:
            best = (placement, cost)
    if best is None:
        first = next((i for i in infos if i.kind in ("window", "transposed")), None)
        size = _map(first) if first is not None else None
        raise InvalidInput(
            f"no window of the model has an output of at least {grid.rows}x{grid.cols} pixels "
            f"(the first gives {size[0]}x{size[1]}); use a smaller grid or a larger image"
            if size is not None
            else "the model has no convolution or pooling to tile; tiles split feature maps"
        )
    return best
