"""Tiles accept exactly the image sizes and batches the untiled model accepts, no more, no less.

torch floors every window's output size and refuses a map with no pixels, or a batch norm in
train mode that sees one value per channel; the geometry must agree on every size, square or not.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.tiles.layers import describe
from tests.tiles.test_exact import narrow, zoo


def _torch_accepts(model: nn.Sequential, batch: int, height: int, width: int) -> bool:
    try:
        with torch.no_grad():
            model(torch.zeros(batch, 3, height, width))
    except (RuntimeError, ValueError):
        return False
    return True


def _tiles_accept(model: nn.Sequential, batch: int, height: int, width: int) -> bool:
    try:
        describe(model, 3, height, width).check_batch(batch)
    except InvalidInput:
        return False
    return True


@pytest.mark.parametrize("name, build", [("yolov2-16 geometry", narrow), ("zoo", zoo)])
def test_tiles_accept_the_sizes_and_batches_torch_accepts(name, build):
    torch.manual_seed(0)
    model = build().train()
    # every square size up to two of YOLOv2-16's /16 steps, and non-square ones near the edges
    sizes = [(h, h) for h in range(1, 35)] + [(15, 40), (40, 15), (16, 1), (31, 16), (32, 17)]
    for batch in (1, 2):
        for height, width in sizes:
            expected = _torch_accepts(model, batch, height, width)
            assert _tiles_accept(model, batch, height, width) == expected, (batch, height, width)
