"""The grouping cost model and its dynamic program (pure), and the device profiles."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetrain.devices import CLUSTERS, Cluster, Link, load
from edgetrain.errors import InvalidInput
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.grouping import (
    GRADIENT_BUCKET_BYTES,
    allreduce_seconds,
    exchange_seconds,
    gradient_buckets,
    grid_for,
    optimise,
    single_core_seconds,
    step_cost,
    sync_points,
    weight_sync_seconds,
)
from edgetrain.tiles.tiling import Layer, Network, Region, Transfer, Window


def _net(size: int = 32) -> Network:
    def conv(cin: int, cout: int, k: int = 3) -> Layer:
        w = Window(k, 1, k // 2)
        return Layer("conv", "conv", cin, cout, w, w, cout * cin * k * k + 3 * cout, True, 99)

    def pool(c: int) -> Layer:
        return Layer("pool", "pool", c, c, Window(2, 2), Window(2, 2), 4 * c)

    layers = (conv(3, 8), pool(8), conv(8, 16), conv(16, 8, 1), conv(8, 16), pool(16), conv(16, 8))
    return Network(layers, 3, size, size)


def _all_groupings(n: int):
    for mask in range(2 ** (n - 1)):
        bounds = [0, *(i + 1 for i in range(n - 1) if mask >> i & 1), n]
        yield tuple((bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1))


@pytest.mark.parametrize("profile", sorted(CLUSTERS))
@pytest.mark.parametrize("grid", [Grid(1, 2), Grid(2, 2), Grid(2, 3)])
def test_the_dynamic_program_finds_the_cheapest_of_all_groupings(profile, grid):
    net, cluster = _net(), CLUSTERS[profile]
    best = optimise(net, grid, cluster, batch=2)
    brute = min(step_cost(net, grid, g, cluster, batch=2).seconds for g in _all_groupings(7))
    assert best.seconds == pytest.approx(brute, rel=1e-12)
    assert step_cost(net, grid, best.grouping, cluster, batch=2).seconds == pytest.approx(
        best.seconds, rel=1e-12
    )


def test_a_free_network_makes_per_layer_groups_best_since_they_recompute_nothing():
    free = Link("free", 1e30, 0.0, False)
    cluster = replace(CLUSTERS["pi3-ethernet"], link=free)
    best = optimise(_net(), Grid(2, 2), cluster)
    assert best.redundancy == pytest.approx(1.0)
    assert len(best.grouping) > 1


def test_a_network_with_huge_latency_makes_one_group_best():
    slow = Link("slow", 1e3, 100.0, True)
    cluster = replace(CLUSTERS["pi3-wifi"], link=slow)
    best = optimise(_net(), Grid(2, 2), cluster)
    assert best.grouping == ((0, 6),)
    assert best.redundancy > 1.0


def test_one_device_has_no_communication_and_chooses_one_group():
    cluster = CLUSTERS["pi3-ethernet"]
    best = optimise(_net(), Grid(1, 1), cluster)
    assert best.grouping == ((0, 6),)
    assert best.communication_seconds == 0.0
    # one device uses all its cores: faster than one core by cores x efficiency
    device = cluster.device
    assert single_core_seconds(_net(), cluster) / best.seconds == pytest.approx(
        device.cores * device.parallel_efficiency
    )


def test_the_predicted_halo_bytes_are_the_geometry_bytes_both_ways():
    from edgetrain.tiles.tiling import plan

    net, grid = _net(), Grid(2, 2)
    grouping = ((0, 1), (2, 4), (5, 6))
    cost = step_cost(net, grid, grouping, CLUSTERS["pi3-ethernet"], batch=3, element_bytes=8)
    tiles = plan(net, grid, grouping)
    assert cost.halo_bytes == sum(tiles.halo_bytes_sent(r, 3, 8) for r in range(4))


def test_a_switch_moves_transfers_in_parallel_and_wifi_one_after_another():
    transfers = (Transfer(0, 1, Region(0, 1, 0, 1)), Transfer(2, 3, Region(0, 1, 0, 1)))
    switch = Link("switch", 1000.0, 0.0, False)
    wifi = Link("wifi", 1000.0, 0.0, True)
    assert exchange_seconds(transfers, [500, 500], switch) == pytest.approx(0.5)
    assert exchange_seconds(transfers, [500, 500], wifi) == pytest.approx(1.0)


def test_ring_allreduce_sends_twice_the_data_times_p_minus_one_over_p():
    link = Link("l", 100.0, 0.0, False)
    assert allreduce_seconds(1000, 4, link) == pytest.approx(2 * 3 / 4 * 1000 / 100)
    assert allreduce_seconds(1000, 1, link) == 0.0


def test_more_devices_on_ethernet_predict_faster_steps_for_yolov2_sized_maps():
    net, cluster = _net(416), CLUSTERS["pi3-ethernet"]
    times = [optimise(net, grid_for(d), cluster).seconds for d in (1, 2, 4)]
    assert times[0] > times[1] > times[2]


def test_grid_for_is_as_square_as_the_count_allows():
    assert [str(grid_for(d)) for d in range(1, 7)] == ["1x1", "1x2", "1x3", "2x2", "1x5", "2x3"]
    assert str(grid_for(12)) == "3x4"


def test_every_built_in_profile_names_its_sources():
    for cluster in CLUSTERS.values():
        assert cluster.device.source and cluster.link.source
        assert cluster.device.macs_per_second > cluster.device.core_macs_per_second


def test_a_profile_loads_from_json(tmp_path):
    cluster = CLUSTERS["pi3-wifi"]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(cluster.to_json()))
    assert load(str(path)) == cluster
    assert isinstance(load("pi3-ethernet"), Cluster)


def test_an_unknown_profile_is_an_error_listing_the_choices():
    with pytest.raises(InvalidInput, match="pi3-ethernet"):
        load("pi4-5g")


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), max_size=30),
    cap=st.integers(1, 4000),
)
def test_gradient_buckets_keep_the_order_and_the_cap(sizes, cap):
    buckets = gradient_buckets(sizes, cap)
    flat = [i for bucket in buckets for i in bucket]
    assert flat == [i for i, size in enumerate(sizes) if size > 0]  # each once, in order
    for bucket in buckets:
        assert len(bucket) == 1 or sum(sizes[i] for i in bucket) <= cap
    for before, after in itertools.pairwise(buckets):
        # a bucket closes only when the next unit would not fit
        assert sum(sizes[i] for i in before) + sizes[after[0]] > cap


def test_the_weight_sync_pays_the_latencies_of_each_bucket():
    link = Link("l", 100.0, 0.01, False)
    small, large = 1000, 3 * GRADIENT_BUCKET_BYTES
    one = weight_sync_seconds([small, small, small], 2, link)
    assert one == pytest.approx(allreduce_seconds(3 * small, 2, link))
    two = weight_sync_seconds([small, large, small], 2, link)
    assert two == pytest.approx(sum(allreduce_seconds(b, 2, link) for b in (small, large, small)))


def test_a_batch_norm_ending_a_group_rides_on_the_next_halo_exchange():
    net, grid = _net(), Grid(1, 2)
    cluster = replace(CLUSTERS["pi3-ethernet"], link=Link("slow", 1e12, 1.0, False))
    # layer 2 (a 3x3 conv with batch norm) ends the first group in both groupings; layer 3 is
    # a 1x1 conv (no halo), so both boundaries are rounds of batch-norm statistics only
    split = step_cost(net, grid, ((0, 2), (3, 6)), cluster)
    whole = step_cost(net, grid, ((0, 6),), cluster)
    assert split.groups[0].batchnorm_seconds == pytest.approx(2.0, abs=0.01)  # layer 0 only
    assert split.groups[1].halo_seconds == pytest.approx(2.0, abs=0.01)  # the merged round
    # the same number of rounds either way: splitting after a batch norm costs no latency
    assert split.seconds - split.compute_seconds == pytest.approx(
        whole.seconds - whole.compute_seconds, abs=0.01
    )


def test_synchronisation_points_count_batch_norms_and_bare_halo_rounds():
    net, grid = _net(), Grid(1, 2)
    norms = sum(layer.batchnorm for layer in net.layers)  # 5 convolutions with batch norm
    assert sync_points(net, grid, ((0, 6),), 0) == 2 * norms + 1
    # after the pool (layer 1) the 3x3 conv's halo is a round of its own; after layer 2's
    # batch norm it travels with the statistics
    assert sync_points(net, grid, ((0, 1), (2, 2), (3, 6)), 0) == 2 * norms + 1 + 2
    assert sync_points(net, Grid(1, 1), ((0, 6),), 0) == 0
