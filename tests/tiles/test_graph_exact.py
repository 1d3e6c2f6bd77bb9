"""Any CNN torch.fx captures, tiled end to end on torch.distributed (gloo), equals one process in
float64: output, input gradient, every weight gradient, the weights and batch-norm statistics
after two SGD steps.

The models have residual additions (ResNet-18 and -50 in their module form, MobileNetV2),
channel concatenations and transposed convolutions (the U-Net), a 1x1 strided downsampling
(ResNet), depthwise convolutions (MobileNetV2), global average pooling summed over tiles and a
Linear head run on every rank, and a plain chain (YOLOv2-16). Each runs fully tiled up to its
global pooling (the last cut) and at the cut the cost model chooses, on uneven tiles where the
sizes allow (1x2 and 2x2 grids, images the poolings floor: 67 px for YOLOv2-16, 40 px for a
three-level U-Net).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgetrain.devices import load
from edgetrain.models import build, thirdparty
from edgetrain.models.mobilenetv2 import MobileNetV2
from edgetrain.models.resnet_module import resnet_module
from edgetrain.models.unet import UNet
from edgetrain.tiles.check import differences, reference
from edgetrain.tiles.graph import analyse, choose_cut
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.launch import run_local
from edgetrain.tiles.worker import TileJob


def _model(name: str) -> nn.Module:
    torch.manual_seed(3)
    if name == "resnet18":
        return resnet_module(18, num_classes=10)
    if name == "resnet50":
        return thirdparty.torchvision().models.resnet50(num_classes=10)
    if name == "mobilenetv2":
        return MobileNetV2(num_classes=10, width=0.25, dropout=0.2)
    if name == "unet":
        return UNet(classes=2, base=4, depth=3)
    return build(name)


# (model, image, batch, cut: "last" = everything a map reaches, "auto" = the cost model's)
CASES = {
    "1x2": [
        ("resnet18", 64, 2, "last"),
        ("resnet18", 64, 2, "auto"),
        ("resnet50", 64, 2, "last"),  # 53 batch norms, the last over 2x2 maps: see ROUNDING
        ("mobilenetv2", 96, 2, "last"),
        ("mobilenetv2", 96, 2, "auto"),
        ("unet", 40, 2, "last"),
        ("yolov2-16", 67, 2, "last"),
    ],
    "2x2": [
        ("resnet18", 72, 2, "last"),
        ("unet", 40, 1, "last"),
        ("yolov2-16", 67, 1, "auto"),
    ],
}


def _job(grid: Grid, case: tuple[str, int, int, str]) -> TileJob:
    name, image, batch, cut = case
    model = _model(name)
    graph, infos = analyse(model, torch.zeros(batch, 3, image, image))
    chosen = choose_cut(graph, infos, grid, load("pi3-ethernet"))[0].cut
    return TileJob(
        model,
        (image, image),
        batch,
        grid,
        (),
        steps=2,
        dtype="float64",
        collect=True,
        measure_memory=False,
        cut=len(infos) if cut == "last" else chosen,
    )


ROUNDING = {"resnet50": 1e-8}
"""Models whose float64 runs may differ by more than 1e-10 from rounding alone: ResNet-50 at 64 px
normalises 2x2 maps of two images (8 values per channel) in its last stage, and its 53 batch norms
amplify the different summation order of tiled statistics (about 1e-9 here, 1.6e-10 at 128 px;
a wrong pixel would differ by its own size, about 1)."""


_RUNS: dict[str, tuple[list[TileJob], list]] = {}


def _runs(grid: str) -> tuple[list[TileJob], list]:
    """Launch the grid's process group once and run every case in it."""
    if grid not in _RUNS:
        shape = Grid(*map(int, grid.split("x")))
        jobs = [_job(shape, case) for case in CASES[grid]]
        _RUNS[grid] = (jobs, run_local(jobs, threads=1, timeout=300))
    return _RUNS[grid]


@pytest.mark.parametrize(
    ("grid", "index"),
    [
        # one xdist worker per grid: another would launch the grid's process group again
        pytest.param(g, i, marks=pytest.mark.xdist_group(f"tiles-graph-{g}"))
        for g, cases in CASES.items()
        for i in range(len(cases))
    ],
)
def test_graph_model_tiled_equals_one_process(grid: str, index: int) -> None:
    jobs, results = _runs(grid)
    job = jobs[index]
    diff = differences(job, results[index], reference(job))
    assert diff.pop("ranks_agree") == 0.0
    worst = max(diff, key=lambda k: diff[k])
    tolerance = ROUNDING.get(CASES[grid][index][0], 1e-10)
    assert diff[worst] <= tolerance, (CASES[grid][index], worst, diff[worst])
