"""Tiled training on torch.distributed (gloo) equals one process: output, input gradient, every
weight gradient and the weights and batch-norm statistics after two SGD steps.

One process group per grid (spawning costs seconds), many configurations inside it: YOLOv2-16
with one group, per-layer groups and mixed groups, and a zoo network with a strided convolution,
dilation, overlapping max pooling with padding, average pooling, batch norm without affine and
with cumulative momentum, a batch norm in a layer of its own and a 1x1 convolution with stride 2
(which skips every other row).

Image sizes are the ones torch floors: YOLOv2-16 at 67 and 97 px (its 2x2/2 poolings drop a row
or column of odd maps, which batch norm still counts) and, at an eighth of its width so that the
suite stays fast, at 200 px (the fourth pooling drops row 24 of 25) and 130 px, on grids whose
tiles are uneven (3x2 and 2x3).

float64 must agree within 1e-10. float32 must agree within 1e-4 on these inputs; in general a
float32 run can legitimately split from another where an activation lies within rounding of a
LeakyReLU kink or a max-pool tie (the two runs then pick different subgradients), which is why
``edgetrain tiles --check --dtype float64`` is the sharp check of a cluster (docs/tiles.md).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from edgetrain.models import build
from edgetrain.models.yolov2 import YOLOV2_16, conv_bn_leaky
from edgetrain.tiles.check import differences, reference
from edgetrain.tiles.grid import Grid, parse_groups
from edgetrain.tiles.grouping import sync_points
from edgetrain.tiles.launch import run_local
from edgetrain.tiles.worker import TileJob

TOLERANCE = {"float64": 1e-10, "float32": 1e-4}


def zoo() -> nn.Sequential:
    """Every window and normalisation tiling supports, 64 px in, 4 px out (59 px: the average
    pooling drops the last row and column of a 15-pixel map)."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=2, dilation=2, bias=False),
            nn.BatchNorm2d(8, momentum=None),
            nn.LeakyReLU(0.1),
        ),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Sequential(
            nn.Conv2d(8, 12, 5, padding=2, bias=False), nn.BatchNorm2d(12, affine=False), nn.SiLU()
        ),
        nn.AvgPool2d(2),
        nn.Sequential(nn.Conv2d(12, 6, 1), nn.Tanh()),
        nn.Sequential(nn.BatchNorm2d(6), nn.Hardswish()),
        nn.Sequential(nn.Conv2d(6, 4, 1, stride=2), nn.BatchNorm2d(4), nn.ReLU()),
    )


def narrow() -> nn.Sequential:
    """YOLOv2-16's sixteen layers at an eighth of its width: its geometry, cheap at 200 px."""
    layers: dict[str, nn.Module] = {}
    channels = 3
    for index, (kind, filters, size) in enumerate(YOLOV2_16):
        if kind == "conv":
            layers[f"conv{index}"] = conv_bn_leaky(channels, filters // 8, size)
            channels = filters // 8
        else:
            layers[f"max{index}"] = nn.MaxPool2d(size, stride=size)
    return nn.Sequential(OrderedDict(layers))


def _model(name: str) -> nn.Sequential:
    torch.manual_seed(7)
    return {"zoo": zoo, "narrow": narrow}.get(name, lambda: build(name))()


# (model, image, batch, groups, dtype) per grid; image sizes give uneven tiles where they can:
# yolov2-16 at 48 px ends at 3x3 (1x2 grid: 1 + 2), at 64 px at 4x4 (3 rows: 1 + 1 + 2), at 67 px
# at 4x4 (67 -> 33 -> 16: two poolings drop a row), at 97 px at 6x6 (97 -> 48: one drop), at
# 130 px at 8x8 (65 -> 32), at 200 px at 12x12 (25 -> 12, the case users hit first).
CASES: dict[str, list[tuple[str, int | tuple[int, int], int, str, str]]] = {
    "1x2": [
        ("yolov2-16", 48, 2, "1", "float64"),
        ("yolov2-16", 48, 2, "per-layer", "float64"),
        ("yolov2-16", 48, 2, "0-3,4-7,8-15", "float64"),
        ("yolov2-16", 48, 2, "0-3,4-7,8-15", "float32"),
        ("zoo", 64, 2, "0-1,2-4,5-7", "float64"),
        ("yolov2-16", 67, 3, "per-layer", "float64"),
        ("narrow", 200, 1, "0-3,4-7,8-15", "float64"),
    ],
    "2x2": [
        ("yolov2-16", 64, 1, "1", "float64"),
        ("yolov2-16", 64, 1, "per-layer", "float64"),
        ("yolov2-16", 64, 1, "0-1,2-6,7,8-15", "float64"),
        ("yolov2-16", 64, 1, "per-layer", "float32"),
        ("zoo", 64, 2, "per-layer", "float64"),
        ("yolov2-16", 97, 1, "1", "float64"),
        ("narrow", 130, 2, "per-layer", "float64"),
        ("zoo", 59, 1, "0-2,3-7", "float64"),
        ("yolov2-16", (37, 50), 2, "0-3,4-7,8-15", "float64"),
    ],
    "3x2": [
        ("yolov2-16", 64, 1, "1", "float64"),
        ("yolov2-16", 64, 1, "0-5,6-11,12-15", "float64"),
        ("zoo", 64, 1, "0-2,3,4-7", "float64"),
        ("yolov2-16", 67, 1, "0-1,2-6,7,8-15", "float64"),
        ("narrow", 200, 1, "per-layer", "float64"),
    ],
    "2x3": [
        ("zoo", 59, 2, "1", "float64"),
        ("yolov2-16", 97, 2, "0-5,6-11,12-15", "float64"),
        ("narrow", 130, 1, "1", "float64"),
        ("narrow", 200, 1, "1", "float64"),
    ],
}


def _job(grid: str, case: tuple[str, int | tuple[int, int], int, str, str]) -> TileJob:
    model, image, batch, groups, dtype = case
    net = _model(model)
    return TileJob(
        net,
        image if isinstance(image, tuple) else (image, image),
        batch,
        Grid(*map(int, grid.split("x"))),
        parse_groups(groups, len(net)),
        steps=2,
        dtype=dtype,
        collect=True,
        measure_memory=False,
    )


_RUNS: dict[str, tuple[list[TileJob], list]] = {}


def _runs(grid: str):
    """Launch the grid's process group once and run every case in it."""
    if grid not in _RUNS:
        jobs = [_job(grid, case) for case in CASES[grid]]
        _RUNS[grid] = (jobs, run_local(jobs, timeout=60.0))
    return _RUNS[grid]


PARAMS = [(grid, i) for grid in CASES for i in range(len(CASES[grid]))]


def _on_its_grids_worker(grid: str, *values: object):
    """The parameters, marked to run on one xdist worker per grid: another worker would launch
    the grid's process group again."""
    return pytest.param(grid, *values, marks=pytest.mark.xdist_group(f"tiles-exact-{grid}"))


def _name(grid: str, case: tuple[str, int | tuple[int, int], int, str, str]) -> str:
    model, image, batch, groups, dtype = case
    size = "x".join(map(str, image)) if isinstance(image, tuple) else str(image)
    return f"{grid}-{model}-{size}px-b{batch}-{groups}-{dtype}"


@pytest.mark.parametrize(
    "grid, index",
    [_on_its_grids_worker(g, i) for g, i in PARAMS],
    ids=[_name(g, CASES[g][i]) for g, i in PARAMS],
)
def test_tiled_training_equals_one_process(grid, index):
    jobs, results = _runs(grid)
    job, ranks = jobs[index], results[index]
    assert len(ranks) == job.grid.size
    diffs = differences(job, ranks, reference(job))
    assert diffs.pop("ranks_agree") == 0.0  # every rank holds bit-identical weights
    worst = max(diffs, key=diffs.__getitem__)
    assert diffs[worst] <= TOLERANCE[job.dtype], f"{worst} differs by {diffs[worst]:.3g}"
    assert {"output", "input_grad"} <= set(diffs)
    assert sum(k.startswith("grad:") for k in diffs) == len(list(job.model.parameters()))


@pytest.mark.parametrize("grid", [_on_its_grids_worker(grid) for grid in CASES])
def test_measured_halo_bytes_equal_the_geometry(grid):
    jobs, results = _runs(grid)
    for job, ranks in zip(jobs, results, strict=True):
        element = 8 if job.dtype == "float64" else 4
        tiles = job.plan()
        for r in ranks:
            assert r.halo_bytes == job.steps * tiles.halo_bytes_sent(r.rank, job.batch, element)
            assert r.halo_messages == job.steps * tiles.messages(r.rank)


@pytest.mark.parametrize("grid", [_on_its_grids_worker(grid) for grid in CASES])
def test_each_rank_waits_as_often_as_the_cost_model_counts(grid):
    jobs, results = _runs(grid)
    for job, ranks in zip(jobs, results, strict=True):
        net = job.network()
        for r in ranks:
            expected = sync_points(net, job.grid, job.grouping, r.rank)
            assert r.sync_points == job.steps * expected, (job.grouping, r.rank)


@pytest.mark.parametrize("grid", [_on_its_grids_worker(grid) for grid in CASES])
def test_workers_listen_only_on_loopback(grid):
    _, results = _runs(grid)
    addresses = [a for ranks in results for r in ranks for a in r.listening]
    assert addresses, "gloo should hold listening sockets"
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


@pytest.mark.xdist_group("tiles-exact-1x2")
def test_a_wrong_model_would_be_caught():
    """The comparison can fail: a tiled run of different weights is far off."""
    jobs, results = _runs("1x2")
    job = jobs[1]
    other = _job("1x2", CASES["1x2"][1])
    with torch.no_grad():
        next(other.model.parameters()).mul_(1.5)
    diffs = differences(job, results[1], reference(other))
    diffs.pop("ranks_agree")
    assert max(diffs.values()) > 1e-3
