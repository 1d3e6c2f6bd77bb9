"""The first 16 layers of YOLOv2 (Darknet ``yolov2.cfg``) as an ``nn.Sequential``.

Each convolutional layer is Conv2d (no bias) + BatchNorm2d + LeakyReLU(0.1) with "same" padding;
each max-pool is 2×2 with stride 2. These are the feature-map-dominated layers that tile-parallel
training splits across devices (Rama et al.). Layer ``i`` of the Sequential is Darknet layer ``i``.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

# ("conv", filters, size) or ("max",): Darknet yolov2.cfg layers 0-15.
YOLOV2_16: tuple[tuple[str, int, int], ...] = (
    ("conv", 32, 3),
    ("max", 0, 2),
    ("conv", 64, 3),
    ("max", 0, 2),
    ("conv", 128, 3),
    ("conv", 64, 1),
    ("conv", 128, 3),
    ("max", 0, 2),
    ("conv", 256, 3),
    ("conv", 128, 1),
    ("conv", 256, 3),
    ("max", 0, 2),
    ("conv", 512, 3),
    ("conv", 256, 1),
    ("conv", 512, 3),
    ("conv", 256, 1),
)


def conv_bn_leaky(cin: int, cout: int, size: int) -> nn.Sequential:
    """Darknet's convolutional layer: conv (stride 1, same padding) + batch norm + leaky ReLU."""
    return nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(cin, cout, size, stride=1, padding=size // 2, bias=False),
            bn=nn.BatchNorm2d(cout),
            act=nn.LeakyReLU(0.1),
        )
    )


def yolov2_16(in_channels: int = 3) -> nn.Sequential:
    """Darknet YOLOv2 layers 0-15: 13 convolutions and 4 max-pools (output: 256 channels, /16)."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    cin = in_channels
    for index, (kind, filters, size) in enumerate(YOLOV2_16):
        if kind == "conv":
            layers[f"conv{index}"] = conv_bn_leaky(cin, filters, size)
            cin = filters
        else:
            layers[f"max{index}"] = nn.MaxPool2d(size, stride=size)
    return nn.Sequential(layers)
