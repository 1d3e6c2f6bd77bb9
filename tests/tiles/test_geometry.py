"""Tile geometry (pure): grids, receptive fields, ownership, halos, and the errors users see."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from edgetrain.errors import InvalidInput
from edgetrain.tiles.grid import Grid, format_grouping, parse_grid, parse_groups, split
from edgetrain.tiles.tiling import Layer, Network, Region, Window, plan, smallest_image


def conv(k: int = 3, s: int = 1, p: int | None = None, d: int = 1, cin: int = 4, cout: int = 4):
    pad = (d * (k - 1)) // 2 if p is None else p
    w = Window(k, s, pad, d)
    return Layer("conv", "conv", cin, cout, w, w, cout * cin * k * k, True, cout * cin * k * k)


def pool(k: int = 2, s: int = 2, p: int = 0, c: int = 4):
    w = Window(k, s, p)
    return Layer("pool", "pool", c, c, w, w, c * k * k)


# --- small pieces ------------------------------------------------------------------------------


def test_split_gives_the_remainder_to_the_last_tile():
    assert split(13, 2) == ((0, 6), (6, 13))
    assert split(4, 3) == ((0, 1), (1, 2), (2, 4))
    assert split(5, 5) == tuple((i, i + 1) for i in range(5))


def test_split_refuses_more_tiles_than_pixels():
    with pytest.raises(InvalidInput, match="cannot cut 3 pixels into 4 tiles"):
        split(3, 4)


@pytest.mark.parametrize("text, rows, cols", [("2x2", 2, 2), ("1X3", 1, 3), (" 3 x 2 ", 3, 2)])
def test_parse_grid_reads_rows_by_columns(text, rows, cols):
    assert parse_grid(text) == Grid(rows, cols)


@pytest.mark.parametrize("text", ["2", "2x", "x2", "2x2x2", "two by two", "0x2", "-1x2"])
def test_parse_grid_rejects_malformed_grids(text):
    with pytest.raises(InvalidInput, match="grid"):
        parse_grid(text)


def test_parse_groups_forms():
    assert parse_groups("1", 4) == ((0, 3),)
    assert parse_groups("per-layer", 3) == ((0, 0), (1, 1), (2, 2))
    assert parse_groups("2", 4) == ((0, 1), (2, 3))
    assert parse_groups("0-1,2,3-5", 6) == ((0, 1), (2, 2), (3, 5))
    assert format_grouping(((0, 1), (2, 2), (3, 5))) == "0-1,2,3-5"


@pytest.mark.parametrize(
    "text, match",
    [
        ("0-3,5-7", "consecutive"),
        ("0-3,3-7", "consecutive"),
        ("1-7", "starting at 0"),
        ("0-3", "end the last group at 7"),
        ("0-9", "end the last group at 7"),
        ("0-3;4-7", "cannot read groups"),
        ("a-b", "cannot read groups"),
        ("9", "cannot make 9 groups"),
        ("3-1,2-7", "consecutive"),
    ],
)
def test_parse_groups_rejects_bad_groups_with_a_fix(text, match):
    with pytest.raises(InvalidInput, match=match):
        parse_groups(text, 8)


def test_window_needed_span_matches_the_convolution_formula():
    # out[o] reads in[o*s - p + d*t] for t in 0..k-1
    w = Window(kernel=3, stride=2, padding=1, dilation=2)
    assert w.needed((2, 4)) == (2 * 2 - 1, 3 * 2 - 1 + 2 * 2 + 1)
    assert w.output_size(9) == (9 + 2 - 5) // 2 + 1


# --- errors users can cause --------------------------------------------------------------------


def test_more_tiles_than_output_pixels_is_an_error_naming_the_fix():
    net = Network((conv(), pool(), conv()), 4, 8, 8)  # 4x4 output
    with pytest.raises(InvalidInput, match=r"grid 5x1 has more tiles than the 4x4 output"):
        plan(net, Grid(5, 1), ((0, 2),))


def test_a_too_small_image_is_an_error_naming_the_smallest_that_works():
    # three 2x2/2 poolings need 8 pixels; 7 rows leave the third pooling with one
    with pytest.raises(
        InvalidInput, match=r"layer 2 \(pool, pool 2x2/2\) gets 1 rows; .* 8 pixels"
    ):
        Network((pool(), pool(), pool()), 4, 7, 9)
    assert Network((pool(), pool(), pool()), 4, 8, 8).sizes[-1] == (1, 1)
    # padding lowers it: a 3x3 convolution without padding needs 3 pixels, with padding 1
    assert smallest_image((conv(p=0), pool()), "rows") == 4
    assert smallest_image((conv(p=1), pool()), "rows") == 2


def test_a_pooling_that_drops_the_last_row_leaves_it_to_the_last_tile_which_computes_it():
    # 18 -> conv -> 18 -> pool -> 9 -> conv -> 9 -> pool -> 4: the second pooling drops row 8 of
    # its 9-row input. With one group on two grid rows, the tiles are rows 0-1 and 2-3; rank 1's
    # pooling reads rows 4-7 of conv2's output, but rank 1 owns rows 4-8 and computes row 8 too,
    # because batch norm there counts it (as the untiled model does).
    net = Network((conv(), pool(), conv(), pool()), 4, 18, 18)
    group = plan(net, Grid(2, 1), ((0, 3),)).groups[0]
    assert group.tile(1) == Region(2, 4, 0, 4)
    assert group.needed(3, 1) == Region(4, 8, 0, 8)  # the columns drop their last one too
    assert group.owned(3, 1) == Region(4, 9, 0, 9)
    assert group.computed(3, 1) == Region(4, 9, 0, 9)
    # so conv2 on rank 1 reads pool1's rows 3-8 and pads one row below the image
    assert group.needed(2, 1) == Region(3, 9, 0, 9)
    assert group.pads(2, 1) == (1, 1, 0, 1)
    # rank 0's rows are exactly what it needs: nothing is dropped inside the map
    assert group.needed(3, 0) == Region(0, 4, 0, 8)
    assert group.computed(3, 0) == Region(0, 4, 0, 9)


def test_dropped_rows_at_a_group_boundary_stay_with_their_owner_and_are_never_sent():
    net = Network((conv(), pool(), conv(), pool()), 4, 18, 18)
    second = plan(net, Grid(2, 1), ((0, 2), (3, 3))).groups[1]
    assert second.owned(0, 1) == Region(4, 9, 0, 9)  # rank 1's tile of conv2 holds row 8
    assert second.input(1) == Region(4, 8, 0, 8)  # which nobody reads
    assert second.transfers() == ()


def test_a_stride_that_skips_pixels_leaves_them_to_their_owner():
    # a 1x1 convolution with stride 2 reads rows 0, 2, 4, 6 of 8; rank 0 owns rows 0-3 of its
    # input, needs 0-2, and computes row 3 only because batch norm counts it
    net = Network((conv(), conv(k=1, s=2, p=0)), 4, 8, 8)
    group = plan(net, Grid(2, 1), ((0, 1),)).groups[0]
    assert group.needed(1, 0) == Region(0, 3, 0, 7)
    assert group.computed(1, 0) == Region(0, 4, 0, 8)
    assert group.needed(1, 1) == Region(4, 7, 0, 7)
    assert group.computed(1, 1) == Region(4, 8, 0, 8)


# --- hand-derived halos ------------------------------------------------------------------------


def test_two_convolutions_in_separate_groups_exchange_one_column_each_way():
    # 1x2 grid on 8x8: rank 0 owns columns 0-3 of conv0's output, conv1 needs column 4 too.
    net = Network((conv(cin=3, cout=5), conv(cin=5, cout=6)), 3, 8, 8)
    tiles = plan(net, Grid(1, 2), ((0, 0), (1, 1)))
    second = tiles.groups[1]
    assert second.input(0) == Region(0, 8, 0, 5)
    assert second.input(1) == Region(0, 8, 3, 8)
    sent = {(t.src, t.dst): t.region for t in second.transfers()}
    assert sent == {(1, 0): Region(0, 8, 4, 5), (0, 1): Region(0, 8, 3, 4)}
    # 8 pixels x 5 channels, forward and backward, batch 2, fp32
    assert tiles.halo_bytes_sent(0, batch=2, element_bytes=4) == 2 * 8 * 5 * 2 * 4
    assert tiles.groups[0].transfers() == ()


def test_fusing_both_convolutions_moves_the_halo_to_the_image_and_recomputes_it():
    net = Network((conv(cin=3, cout=5), conv(cin=5, cout=6)), 3, 8, 8)
    fused = plan(net, Grid(1, 2), ((0, 1),))
    group = fused.groups[0]
    assert group.input(0) == Region(0, 8, 0, 6)  # two 3x3 windows: 2 columns of halo
    assert group.computed(1, 0) == Region(0, 8, 0, 5)  # conv0 computed one column extra
    assert fused.halo_bytes_sent(0, 1, 4) == 0
    extra_pixels = 8 * 1 * 2  # one redundant column of conv0 on each rank
    assert fused.redundant_macs == extra_pixels * net.layers[0].macs_per_pixel


def test_padding_is_only_at_true_image_borders():
    net = Network((conv(), conv()), 4, 8, 8)
    tiles = plan(net, Grid(2, 2), ((0, 1),))
    group = tiles.groups[0]
    # rank 0 is top-left: pads left and top only; rank 3 bottom-right: right and bottom only
    assert group.pads(0, 0) == (1, 0, 1, 0)
    assert group.pads(1, 0) == (1, 0, 1, 0)
    assert group.pads(0, 3) == (0, 1, 0, 1)


def test_pooling_halves_the_region_and_the_owner_drops_what_it_does_not_need():
    # 13 output rows on 2 grid rows: 6 + 7. The pool's input is 26 rows cut 13 + 13 by the
    # previous group, but rank 0 only needs rows 0-11, and rank 1 needs 12-25 (gets row 12).
    net = Network((conv(), pool()), 4, 26, 26)
    tiles = plan(net, Grid(2, 1), ((0, 0), (1, 1)))
    group = tiles.groups[1]
    assert group.input(0) == Region(0, 12, 0, 26)
    assert group.input(1) == Region(12, 26, 0, 26)
    assert [(t.src, t.dst, t.region) for t in group.transfers()] == [(0, 1, Region(12, 13, 0, 26))]


# --- properties over random networks ----------------------------------------------------------


@st.composite
def networks(draw):
    count = draw(st.integers(1, 5))
    layers = []
    for _ in range(count):
        kind = draw(st.sampled_from(["conv", "pool", "pointwise"]))
        if kind == "conv":
            k = draw(st.integers(1, 4))
            d = draw(st.integers(1, 2))
            s = draw(st.integers(1, 2))
            p = draw(st.integers(0, (d * (k - 1)) // 2 + 1))
            layers.append(conv(k, s, p, d))
        elif kind == "pool":
            k = draw(st.integers(2, 3))
            layers.append(pool(k, draw(st.integers(1, k + 1)), draw(st.integers(0, k // 2))))
        else:
            layers.append(Layer("act", "pointwise", 4, 4))
    size = draw(st.integers(4, 40))
    try:
        net = Network(tuple(layers), 4, size, draw(st.integers(4, 40)))
    except InvalidInput:
        assume(False)
        raise
    grid = Grid(draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    # every group output must have a pixel per tile (padding can make later maps larger)
    assume(all(h >= grid.rows and w >= grid.cols for h, w in net.sizes[1:]))
    cuts = sorted(draw(st.sets(st.integers(1, count - 1), max_size=count - 1)) if count > 1 else [])
    bounds = [0, *cuts, count]
    grouping = tuple((bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1))
    return net, grid, grouping


def _covers_exactly(regions: list[Region], whole: Region) -> bool:
    if sum(r.area for r in regions) != whole.area:
        return False
    for i, a in enumerate(regions):
        if not whole.contains(a):
            return False
        for b in regions[i + 1 :]:
            if not a.intersect(b).empty:
                return False
    return True


@settings(max_examples=150, deadline=None)
@given(networks())
def test_owned_regions_partition_every_map_and_lie_inside_what_the_rank_computes(case):
    net, grid, grouping = case
    tiles = plan(net, grid, grouping)
    for group in tiles.groups:
        for level in range(group.last - group.first + 2):
            h, w = net.sizes[group.first + level]
            owned = [group.owned(level, r) for r in range(grid.size)]
            assert _covers_exactly(owned, Region(0, h, 0, w))
            if level > 0:  # the group input is read or received, not computed
                for r in range(grid.size):
                    assert group.computed(level, r).contains(owned[r])


@settings(max_examples=150, deadline=None)
@given(networks())
def test_a_ranks_own_pixels_and_received_halos_tile_its_input_exactly(case):
    net, grid, grouping = case
    tiles = plan(net, grid, grouping)
    for group in tiles.groups[1:]:
        transfers = group.transfers()
        for rank in range(grid.size):
            need = group.input(rank)
            parts = [need.intersect(group.owned(0, rank))]
            parts += [t.region for t in transfers if t.dst == rank]
            assert _covers_exactly([p for p in parts if not p.empty], need)
            assert all(group.owned(0, t.src).contains(t.region) for t in transfers)


def _dependencies(windows: list[Window], size: int, outputs: range) -> set[int]:
    """Brute force: the input pixels that ``outputs`` of a chain of windows read."""
    sizes = [size]
    for w in windows:
        sizes.append(w.output_size(sizes[-1]))
    wanted = set(outputs)
    for w, n in zip(reversed(windows), reversed(sizes[:-1]), strict=True):
        reads = set()
        for o in wanted:
            for t in range(w.kernel):
                i = o * w.stride - w.padding + t * w.dilation
                if 0 <= i < n:
                    reads.add(i)
        wanted = reads
    return wanted


@settings(max_examples=150, deadline=None)
@given(networks())
def test_the_traced_region_holds_every_pixel_the_rank_computes_from(case):
    """A rank reads what its tile depends on, and what the pixels it owns inside the group depend
    on (batch norm counts those, even rows no window reads): exactly that, without holes."""
    net, grid, grouping = case
    tiles = plan(net, grid, grouping)
    for group in tiles.groups:
        windows = [net.layers[i].rows for i in group.layers]
        size = net.sizes[group.first][0]
        for rank in range(grid.size):
            need = group.input(rank)
            deps: set[int] = set()
            for level in range(1, len(windows) + 1):
                own = group.owned(level, rank)
                deps |= _dependencies(windows[:level], size, range(own.top, own.bottom))
            tile = group.tile(rank)
            assert deps >= _dependencies(windows, size, range(tile.top, tile.bottom))
            assert all(need.top <= i < need.bottom for i in deps)
            if deps and all(w.dilation == 1 and w.padding < w.extent for w in windows):
                # without holes in the windows (nor windows of padding alone), the traced span
                # is exactly the dependency hull
                assert (need.top, need.bottom) == (min(deps), max(deps) + 1)


@settings(max_examples=150, deadline=None)
@given(networks())
def test_padding_appears_only_where_the_region_touches_the_image_border(case):
    net, grid, grouping = case
    tiles = plan(net, grid, grouping)
    for group in tiles.groups:
        for step in range(group.last - group.first + 1):
            h, w = net.sizes[group.first + step]
            for rank in range(grid.size):
                left, right, top, bottom = group.pads(step, rank)
                region = group.needed(step, rank)
                assert top == 0 or region.top == 0
                assert bottom == 0 or region.bottom == h
                assert left == 0 or region.left == 0
                assert right == 0 or region.right == w


@settings(max_examples=150, deadline=None)
@given(networks())
def test_tiles_of_every_group_output_partition_it_and_the_last_row_takes_the_rest(case):
    net, grid, grouping = case
    tiles = plan(net, grid, grouping)
    for group in tiles.groups:
        h, w = net.sizes[group.last + 1]
        regions = [group.tile(r) for r in range(grid.size)]
        assert _covers_exactly(regions, Region(0, h, 0, w))
        assert regions[0].height == h // grid.rows and regions[0].width == w // grid.cols
        assert regions[-1].height == h - (grid.rows - 1) * (h // grid.rows)


@settings(max_examples=150, deadline=None)
@given(networks())
def test_each_window_reads_exactly_what_yields_the_region_its_rank_computes(case):
    """The needed region, padded, run through the layer's window without its own padding, gives
    the next level's computed region, pixel for pixel, and lies inside what the rank holds."""
    net, grid, grouping = case
    tiles = plan(net, grid, grouping)
    for group in tiles.groups:
        for step, index in enumerate(group.layers):
            layer = net.layers[index]
            for rank in range(grid.size):
                read, out = group.needed(step, rank), group.computed(step + 1, rank)
                left, right, top, bottom = group.pads(step, rank)
                assert group.computed(step, rank).contains(read)
                for window, (a, b), before, after, (c, d) in (
                    (layer.rows, (read.top, read.bottom), top, bottom, (out.top, out.bottom)),
                    (layer.cols, (read.left, read.right), left, right, (out.left, out.right)),
                ):
                    assert a - before == c * window.stride - window.padding
                    unpadded = Window(window.kernel, window.stride, 0, window.dilation)
                    assert unpadded.output_size(b - a + before + after) == d - c


@settings(max_examples=150, deadline=None)
@given(networks())
def test_every_pixel_of_every_inner_map_is_computed_by_its_owner(case):
    """What batch norm needs: the owners of a map cover all of it (rows that feed nothing, which
    floor division drops or a stride skips, included), each inside what the owner computes."""
    net, grid, grouping = case
    tiles = plan(net, grid, grouping)
    for group in tiles.groups:
        for level in range(1, group.last - group.first + 2):
            h, w = net.sizes[group.first + level]
            covered = set()
            for rank in range(grid.size):
                own = group.owned(level, rank)
                assert group.computed(level, rank).contains(own)
                covered |= {
                    (y, x) for y in range(own.top, own.bottom) for x in range(own.left, own.right)
                }
            assert covered == {(y, x) for y in range(h) for x in range(w)}
