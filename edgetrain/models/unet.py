"""A small U-Net (Ronneberger et al. 2015): long skip connections joined by concatenation.

``depth`` down steps (two 3×3 convolutions with BatchNorm and ReLU, then a 2×2 max-pool, channels
doubling from ``base``), a bottom double convolution, and ``depth`` up steps (a 2×2 transposed
convolution, concatenation with the encoder's feature map of the same size, two 3×3
convolutions), then a 1×1 convolution to ``classes`` channels per pixel. Padding keeps sizes, so
the image side must be a multiple of 2**depth. Every skip stays alive from the encoder to the
decoder: few points of the graph carry a single tensor.
"""

from __future__ import annotations

import torch
from torch import nn


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


class UNet(nn.Module):
    """U-Net with ``depth`` levels, ``base`` channels at the top, ``classes`` output maps."""

    def __init__(self, classes: int = 2, base: int = 16, depth: int = 4, in_channels: int = 3):
        super().__init__()
        widths = [base * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        cin = in_channels
        for width in widths[:-1]:
            self.down.append(_double_conv(cin, width))
            cin = width
        self.pool = nn.MaxPool2d(2)
        self.bottom = _double_conv(widths[-2], widths[-1])
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for width in reversed(widths[:-1]):
            self.up.append(nn.ConvTranspose2d(2 * width, width, 2, stride=2))
            self.merge.append(_double_conv(2 * width, width))
        self.out = nn.Conv2d(base, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([skip, up(x)], dim=1))
        return self.out(x)
