"""ResNet-18/34/50/101/152 (He et al. 2016) as an ``nn.Sequential`` of stages.

The architecture is torchvision's (ResNet v1.5: the stride of a bottleneck block sits on its 3×3
convolution; in-place ReLU; Kaiming initialisation), built from code so nothing is downloaded.
The children of the returned ``nn.Sequential`` are the stages edgetrain plans over:
``stem`` (conv 7×7/2, BatchNorm, ReLU, max-pool 3×3/2), one stage per residual block, and
``head`` (global average pool, flatten, fully connected layer).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

# depth -> (block kind, blocks per group)
ARCHITECTURES: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(width, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (carrying the stride), 1×1 expand, residual (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


def resnet(depth: int, num_classes: int = 1000) -> nn.Sequential:
    """Build ResNet-``depth`` (18, 34, 50, 101 or 152) as a Sequential of stages."""
    kind, counts = ARCHITECTURES[depth]
    block: type[BasicBlock] | type[Bottleneck] = BasicBlock if kind == "basic" else Bottleneck
    stages: OrderedDict[str, nn.Module] = OrderedDict()
    stages["stem"] = nn.Sequential(
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    )
    cin = 64
    for group, (width, count) in enumerate(zip((64, 128, 256, 512), counts, strict=True)):
        for index in range(count):
            stride = 2 if group > 0 and index == 0 else 1
            stages[f"layer{group + 1}_{index}"] = block(cin, width, stride)
            cin = width * block.expansion
    stages["head"] = nn.Sequential(
        nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(cin, num_classes)
    )
    model = nn.Sequential(stages)
    init_like_torchvision(model)
    return model


def init_like_torchvision(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
