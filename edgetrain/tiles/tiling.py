"""Tile geometry for fused tile-parallel training (pure: no torch).

A network here is a list of :class:`Layer` s, one per child of an ``nn.Sequential``, each with at
most one spatial window (a convolution or a pooling) followed by element-wise work (batch norm,
activation). Layers are fused into *groups* of consecutive layers. For every group the output of
its last layer is cut by a :class:`Grid` (rows × columns, the last row and column absorbing the
remainder); rank ``r = row * columns + column`` owns one tile. To compute its tile through the
whole group a rank needs a larger region of the group's input: the tile traced back through every
window (kernel, stride, padding, dilation) of the group. The part of that region it does not own
is its *halo*, received from the neighbours that own it; the backward pass sends the gradient of
the same region back (*gradient halo*).

Everything is separable: the rows of a region depend only on the rows of the tile, the columns
only on its columns. So the plan is computed per axis and regions are products of spans.

Windows floor their output size as torch does, so any image the untiled model accepts tiles:
rows that no window reads (dropped at the end of a map, or skipped by a large stride) still
belong to a rank, which computes them because batch norm counts them (see :class:`GroupPlan`).

All spans are half-open ``(start, stop)`` pixel ranges; sizes are pixels unless a name says bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from edgetrain.errors import InvalidInput
from edgetrain.tiles.grid import Grid, Grouping, Span, check_grouping


@dataclass(frozen=True)
class Window:
    """The sliding window of a layer along one axis (all in pixels)."""

    kernel: int = 1
    stride: int = 1
    padding: int = 0
    dilation: int = 1

    @property
    def extent(self) -> int:
        """Pixels from the first to the last input a window touches: ``dilation*(kernel-1)+1``."""
        return self.dilation * (self.kernel - 1) + 1

    def output_size(self, size: int) -> int:
        """Output pixels for ``size`` input pixels (floor mode, as torch computes them)."""
        return (size + 2 * self.padding - self.extent) // self.stride + 1

    def needed(self, out: Span) -> Span:
        """The input span (unclipped, may leave ``[0, size)``) that outputs ``out`` read."""
        start, stop = out
        return (
            start * self.stride - self.padding,
            (stop - 1) * self.stride - self.padding + self.extent,
        )


@dataclass(frozen=True)
class Layer:
    """One child of the network, as far as tiling and costs are concerned.

    Attributes:
        name: the child's name (for messages).
        kind: ``"conv"``, ``"pool"`` or ``"pointwise"`` (no window: batch norm, activation).
        in_channels, out_channels: channels of the layer's input and output.
        rows, cols: the window along the height and the width.
        macs_per_pixel: multiply-accumulates (or comparable element operations) for one output
            pixel over all output channels, window and element-wise work included.
        batchnorm: whether the layer normalises its output with batch statistics.
        parameters: trainable parameter elements (their gradients are all-reduced).
        parameter_tensors: the elements of each trainable tensor, in registration order (the
            weight-gradient buckets follow them); empty: one tensor of ``parameters``.
    """

    name: str
    kind: str
    in_channels: int
    out_channels: int
    rows: Window = Window()
    cols: Window = Window()
    macs_per_pixel: int = 0
    batchnorm: bool = False
    parameters: int = 0
    parameter_tensors: tuple[int, ...] = ()

    def describe(self) -> str:
        """``conv 3x3/1`` style label for messages."""
        if self.kind == "pointwise":
            return "pointwise"
        return f"{self.kind} {self.rows.kernel}x{self.cols.kernel}/{self.rows.stride}"


@dataclass(frozen=True)
class Network:
    """Layers and the input they start from: ``channels`` × ``height`` × ``width`` pixels."""

    layers: tuple[Layer, ...]
    channels: int
    height: int
    width: int

    def __post_init__(self) -> None:
        if not self.layers:
            raise InvalidInput("the network has no layers to tile; give a model with children")
        if self.height < 1 or self.width < 1:
            raise InvalidInput(f"image {self.height}x{self.width} is empty; use a positive size")
        _check_windows(self)

    @cached_property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        """``(height, width)`` of the input (index 0) and of every layer's output (index i+1)."""
        out = [(self.height, self.width)]
        for layer in self.layers:
            h, w = out[-1]
            out.append((layer.rows.output_size(h), layer.cols.output_size(w)))
        return tuple(out)

    def check_batch(self, batch: int) -> None:
        """Raise InvalidInput unless ``batch`` images train: at least one, and every batch norm
        in train mode sees more than one value per channel (torch refuses a single one too)."""
        if batch < 1:
            raise InvalidInput(f"batch {batch} is empty; use at least 1 image")
        for index, layer in enumerate(self.layers):
            h, w = self.sizes[index + 1]
            if layer.batchnorm and batch * h * w == 1:
                raise InvalidInput(
                    f"layer {index} ({layer.name}) normalises a 1x1 map of one image, a single "
                    "value per channel, which batch norm cannot; use a batch of 2 or a larger image"
                )

    def macs(self, first: int = 0, last: int | None = None) -> int:
        """Multiply-accumulates of layers ``first..last`` (inclusive) for one image, untiled."""
        stop = len(self.layers) if last is None else last + 1
        return sum(
            self.layers[i].macs_per_pixel * self.sizes[i + 1][0] * self.sizes[i + 1][1]
            for i in range(first, stop)
        )

    @property
    def parameters(self) -> int:
        """All trainable parameter elements."""
        return sum(x.parameters for x in self.layers)


def _check_windows(net: Network) -> None:
    """Raise InvalidInput for a window torch itself would refuse on this image.

    Tiles reproduce every window torch accepts, with torch's floor division: a window that drops
    the last rows of its input, or a stride that skips pixels between windows, leaves pixels that
    feed nothing downstream. Their owner still computes them (batch norm counts them), and their
    gradient is zero, as in the untiled model. What is left to refuse is a map with no pixels.
    """

    def label(index: int, layer: Layer) -> str:
        return f"layer {index} ({layer.name}, {layer.describe()})"

    for index, layer in enumerate(net.layers):
        for window in (layer.rows, layer.cols):
            if min(window.kernel, window.stride, window.dilation) < 1 or window.padding < 0:
                raise InvalidInput(
                    f"{label(index, layer)} has a non-positive kernel, stride or dilation, or a "
                    "negative padding; fix the model"
                )
    h, w = net.height, net.width
    for index, layer in enumerate(net.layers):
        for axis, size, window in (("rows", h, layer.rows), ("columns", w, layer.cols)):
            if window.output_size(size) < 1:
                smallest = smallest_image(net.layers, "rows" if axis == "rows" else "cols")
                raise InvalidInput(
                    f"image {net.height}x{net.width} is too small: {label(index, layer)} gets "
                    f"{size} {axis}; use an image of at least {smallest} pixels"
                )
        h, w = layer.rows.output_size(h), layer.cols.output_size(w)


def smallest_image(layers: Sequence[Layer], axis: str = "rows") -> int:
    """The fewest input pixels along ``axis`` (``"rows"`` or ``"cols"``) that leave every layer's
    output at least one pixel: traced back from one output pixel, as ``m`` outputs need
    ``(m - 1) * stride + extent - 2 * padding`` inputs."""
    pixels = 1
    for layer in reversed(layers):
        window = layer.rows if axis == "rows" else layer.cols
        pixels = max(1, (pixels - 1) * window.stride + window.extent - 2 * window.padding)
    return pixels


@dataclass(frozen=True)
class Region:
    """A rectangle of pixels: rows ``[top, bottom)`` × columns ``[left, right)``."""

    top: int
    bottom: int
    left: int
    right: int

    @property
    def height(self) -> int:
        return max(0, self.bottom - self.top)

    @property
    def width(self) -> int:
        return max(0, self.right - self.left)

    @property
    def area(self) -> int:
        """Pixels in the region (0 when empty)."""
        return self.height * self.width

    @property
    def empty(self) -> bool:
        return self.area == 0

    def intersect(self, other: Region) -> Region:
        return Region(
            max(self.top, other.top),
            min(self.bottom, other.bottom),
            max(self.left, other.left),
            min(self.right, other.right),
        )

    def contains(self, other: Region) -> bool:
        return other.empty or (
            self.top <= other.top
            and other.bottom <= self.bottom
            and self.left <= other.left
            and other.right <= self.right
        )

    def relative_to(self, outer: Region) -> Region:
        """This region in the coordinates of ``outer`` (whose top-left becomes 0, 0)."""
        return Region(
            self.top - outer.top,
            self.bottom - outer.top,
            self.left - outer.left,
            self.right - outer.left,
        )

    @staticmethod
    def of(rows: Span, cols: Span) -> Region:
        return Region(rows[0], rows[1], cols[0], cols[1])


def region_slices(region: Region) -> tuple[slice, slice, slice, slice]:
    """Index an ``N, C, H, W`` tensor by ``region``."""
    rows, cols = slice(region.top, region.bottom), slice(region.left, region.right)
    return (slice(None), slice(None), rows, cols)


def _map_spans(spans: tuple[Span, ...], stride: int, size: int) -> tuple[Span, ...]:
    """Carry a partition of a layer's output back to its input of ``size`` pixels.

    Each boundary ``b`` becomes ``b * stride`` (at most ``size``); the last span runs to the end
    of the input, so the ranks own every input pixel exactly once, the rows a floor-mode window
    drops at the end included. A span may be empty where padding makes a layer's output larger
    than its input.
    """
    starts = [min(s * stride, size) for s, _ in spans] + [size]
    return tuple((starts[i], starts[i + 1]) for i in range(len(spans)))


@dataclass(frozen=True)
class Transfer:
    """Pixels ``region`` (in the group input's coordinates) that rank ``src`` sends to ``dst``."""

    src: int
    dst: int
    region: Region


@dataclass(frozen=True)
class GroupPlan:
    """How every rank computes one fused group of layers ``first..last``.

    Levels ``k = 0 .. n`` index feature maps: ``k = 0`` is the group input, ``k = j + 1`` the
    output of the group's ``j``-th layer (layer ``first + j``). Per axis and grid row (or
    column):

    * ``needed_*[j][i]``: the span of level ``j`` that layer ``j``'s windows read to produce
      ``computed_*[j + 1][i]``, clipped to the map;
    * ``computed_*[k][i]``: the span a rank in grid row ``i`` holds at level ``k``. At ``k = 0``
      it is ``needed`` (the region it needs of the group input); at ``k = n`` its tile; in
      between the smallest span holding both what the next layer needs and what the rank owns;
    * ``owned_*[k][i]``: a partition of level ``k`` among the grid rows. At ``k = 0`` of a group
      after the first it is the previous group's tiles (what each rank holds); at ``k > 0`` it
      lies inside ``computed`` and says which rank counts a pixel in batch-norm statistics (at
      ``k = 0`` of the first group it partitions the image, which nothing normalises);
    * ``pads_*[j][i]``: the zero padding ``(before, after)`` layer ``j`` needs; non-zero only
      where the region touches the true image border.

    A floor-mode window drops the input rows after its last window (an odd map into a 2x2/2
    pooling), and a stride larger than a window skips rows between windows. Those rows feed
    nothing, yet the untiled model computes them and batch norm counts them, so their owner
    (the last grid row for dropped rows) computes them too: that is why ``computed`` may be
    larger than ``needed``, and why a rank crops to ``needed`` before the window.
    """

    first: int
    last: int
    grid: Grid
    computed_rows: tuple[tuple[Span, ...], ...]
    computed_cols: tuple[tuple[Span, ...], ...]
    owned_rows: tuple[tuple[Span, ...], ...]
    owned_cols: tuple[tuple[Span, ...], ...]
    pads_rows: tuple[tuple[Span, ...], ...]
    pads_cols: tuple[tuple[Span, ...], ...]
    needed_rows: tuple[tuple[Span, ...], ...]
    needed_cols: tuple[tuple[Span, ...], ...]

    @property
    def layers(self) -> range:
        """Indices of the group's layers in the network."""
        return range(self.first, self.last + 1)

    def computed(self, level: int, rank: int) -> Region:
        """The region ``rank`` holds at ``level`` (0 = group input)."""
        i, j = self.grid.position(rank)
        return Region.of(self.computed_rows[level][i], self.computed_cols[level][j])

    def owned(self, level: int, rank: int) -> Region:
        """The region of ``level`` that ``rank`` owns (a partition over ranks)."""
        i, j = self.grid.position(rank)
        return Region.of(self.owned_rows[level][i], self.owned_cols[level][j])

    def needed(self, step: int, rank: int) -> Region:
        """The region of level ``step`` the group's ``step``-th layer reads on ``rank`` (clipped;
        :meth:`pads` adds what lies beyond the image)."""
        i, j = self.grid.position(rank)
        return Region.of(self.needed_rows[step][i], self.needed_cols[step][j])

    def tile(self, rank: int) -> Region:
        """``rank``'s tile of the group output."""
        return self.computed(len(self.computed_rows) - 1, rank)

    def input(self, rank: int) -> Region:
        """The region of the group input ``rank`` needs (its tile plus halo, clipped)."""
        return self.computed(0, rank)

    def pads(self, step: int, rank: int) -> tuple[int, int, int, int]:
        """Zero padding (left, right, top, bottom) for the group's ``step``-th layer."""
        i, j = self.grid.position(rank)
        (top, bottom), (left, right) = self.pads_rows[step][i], self.pads_cols[step][j]
        return (left, right, top, bottom)

    def halo(self, rank: int) -> tuple[int, int, int, int]:
        """Halo pixels (top, bottom, left, right) of ``rank``'s input beyond what it owns."""
        need, own = self.input(rank), self.owned(0, rank)
        return (
            max(0, own.top - need.top),
            max(0, need.bottom - own.bottom),
            max(0, own.left - need.left),
            max(0, need.right - own.right),
        )

    def transfers(self) -> tuple[Transfer, ...]:
        """Halo messages at the group input: who sends which owned pixels to whom.

        The gradient halos of the backward pass are the same regions sent the other way. The first
        group has none: every rank reads its input region straight from the data.
        """
        if self.first == 0:
            return ()
        out = []
        for dst in range(self.grid.size):
            need = self.input(dst)
            for src in range(self.grid.size):
                if src != dst:
                    region = need.intersect(self.owned(0, src))
                    if not region.empty:
                        out.append(Transfer(src, dst, region))
        return tuple(out)


def plan_group(net: Network, grid: Grid, first: int, last: int) -> GroupPlan:
    """Trace every tile of layer ``last``'s output back through layers ``first..last``."""
    sizes = net.sizes[first : last + 2]
    out_h, out_w = sizes[-1]
    if out_h < grid.rows or out_w < grid.cols:
        raise InvalidInput(
            f"grid {grid} has more tiles than the {out_h}x{out_w} output of layer {last} "
            f"({net.layers[last].name}); use a smaller grid or a larger image"
        )
    windows = net.layers[first : last + 1]
    rows = _plan_axis([x.rows for x in windows], [s[0] for s in sizes], grid.row_spans, first)
    cols = _plan_axis([x.cols for x in windows], [s[1] for s in sizes], grid.col_spans, first)
    return GroupPlan(
        first, last, grid, rows[0], cols[0], rows[1], cols[1], rows[2], cols[2], rows[3], cols[3]
    )


def _hull(need: Span, own: Span) -> Span:
    """The smallest span holding ``need`` and ``own`` (an empty span adds nothing)."""
    if own[0] >= own[1]:
        return need
    if need[0] >= need[1]:
        return own
    return (min(need[0], own[0]), max(need[1], own[1]))


def _plan_axis(
    windows: list[Window], sizes: list[int], cut: Callable[[int], tuple[Span, ...]], first: int
) -> tuple[tuple[tuple[Span, ...], ...], ...]:
    """Per axis: (computed spans, owned spans, pads, needed spans) at every level of one group,
    ``cut`` splitting a map of a size among the grid's rows (or columns)."""
    n = len(windows)
    tiles = cut(sizes[n])
    computed: list[tuple[Span, ...]] = [()] * (n + 1)
    owned: list[tuple[Span, ...]] = [()] * (n + 1)
    pads: list[tuple[Span, ...]] = [()] * n
    needed: list[tuple[Span, ...]] = [()] * n
    computed[n] = owned[n] = tiles
    for j in reversed(range(n)):
        window, size = windows[j], sizes[j]
        need = [window.needed(span) for span in computed[j + 1]]
        needed[j] = tuple((max(a, 0), min(b, size)) for a, b in need)
        pads[j] = tuple((max(0, -a), max(0, b - size)) for a, b in need)
        owned[j] = _map_spans(owned[j + 1], window.stride, size)
        if j == 0:
            computed[j] = needed[j]  # the group input is read or received, never computed here
        else:
            computed[j] = tuple(_hull(a, b) for a, b in zip(needed[j], owned[j], strict=True))
    if first > 0:
        # The group input is the previous group's output: each rank owns its tile of it.
        owned[0] = cut(sizes[0])
    for k in range(1, n + 1):
        for own, held in zip(owned[k], computed[k], strict=True):
            if own[0] < own[1] and not (held[0] <= own[0] and own[1] <= held[1]):
                raise AssertionError(f"owned span {own} outside computed {held} (a bug)")
    return tuple(computed), tuple(owned), tuple(pads), tuple(needed)


@dataclass(frozen=True)
class TilePlan:
    """A network cut by a grid into fused groups: the whole geometry of one training step."""

    network: Network
    grid: Grid
    groups: tuple[GroupPlan, ...]

    @property
    def grouping(self) -> Grouping:
        return tuple((g.first, g.last) for g in self.groups)

    @property
    def ranks(self) -> int:
        return self.grid.size

    def layer_macs(self, rank: int) -> tuple[int, ...]:
        """Multiply-accumulates of every layer on ``rank`` for one image (halo included)."""
        out = []
        for group in self.groups:
            for j, index in enumerate(group.layers):
                region = group.computed(j + 1, rank)
                out.append(self.network.layers[index].macs_per_pixel * region.area)
        return tuple(out)

    def macs(self, rank: int) -> int:
        """Forward multiply-accumulates on ``rank`` for one image."""
        return sum(self.layer_macs(rank))

    @property
    def redundant_macs(self) -> int:
        """Forward work all ranks do beyond the untiled network (the halo recomputation)."""
        return sum(self.macs(r) for r in range(self.ranks)) - self.network.macs()

    def halo_elements(self, rank: int, direction: str = "sent") -> int:
        """Feature-map elements of one image ``rank`` sends (or receives) in forward halos.

        ``direction`` is ``"sent"`` or ``"received"``. The backward pass moves the same regions
        the other way: a rank sends as gradient halos what it received as halos.
        """
        total = 0
        for group in self.groups:
            channels = self.network.layers[group.first].in_channels
            for t in group.transfers():
                if (t.src if direction == "sent" else t.dst) == rank:
                    total += t.region.area * channels
        return total

    def halo_bytes_sent(self, rank: int, batch: int, element_bytes: int) -> int:
        """Bytes ``rank`` sends per training step: its forward halos plus the gradient halos of
        what it received."""
        elements = self.halo_elements(rank, "sent") + self.halo_elements(rank, "received")
        return elements * batch * element_bytes

    def messages(self, rank: int) -> int:
        """Point-to-point messages ``rank`` sends per training step (forward and backward)."""
        return sum(1 for g in self.groups for t in g.transfers() if rank in (t.src, t.dst))


def plan(net: Network, grid: Grid, grouping: Grouping) -> TilePlan:
    """The tile plan of ``net`` on ``grid`` with layer groups ``grouping``."""
    check_grouping(grouping, len(net.layers))
    return TilePlan(net, grid, tuple(plan_group(net, grid, a, b) for a, b in grouping))
