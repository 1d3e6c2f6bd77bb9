"""ResNet-18/34/50/101/152 written the standard way: an ``nn.Module`` with a ``forward()``.

The layout is torchvision's (``conv1``, ``bn1``, ``relu``, ``maxpool``, ``layer1`` .. ``layer4``,
``avgpool``, ``fc``) and the blocks are the same classes as the Sequential form in
:mod:`edgetrain.models.resnet`, built in the same order with the same initialisation: under one
seed both forms get identical weights, and :func:`module_state` maps the Sequential form's
``state_dict`` onto this one (outputs then equal bitwise). The Sequential form stays the one the
paper's tables use; this one is what users write, residual connections inside ``forward()``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from edgetrain.models.resnet import (
    ARCHITECTURES,
    BasicBlock,
    Bottleneck,
    init_like_torchvision,
)


class ResNet(nn.Module):
    """ResNet-``depth`` as torchvision lays it out (v1.5: stride on the 3×3 convolution)."""

    def __init__(self, depth: int, num_classes: int = 1000) -> None:
        super().__init__()
        kind, counts = ARCHITECTURES[depth]
        block: type[BasicBlock] | type[Bottleneck] = BasicBlock if kind == "basic" else Bottleneck
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = 64
        groups = []
        for group, (width, count) in enumerate(zip((64, 128, 256, 512), counts, strict=True)):
            blocks = []
            for index in range(count):
                stride = 2 if group > 0 and index == 0 else 1
                blocks.append(block(cin, width, stride))
                cin = width * block.expansion
            groups.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = groups
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        init_like_torchvision(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet_module(depth: int, num_classes: int = 1000) -> ResNet:
    """Build ResNet-``depth`` (18, 34, 50, 101 or 152) as an ordinary module."""
    return ResNet(depth, num_classes)


_STEM = {"stem.0.": "conv1.", "stem.1.": "bn1.", "head.2.": "fc."}
_BLOCK = re.compile(r"^layer(\d)_(\d+)\.")


def module_key(sequential_key: str) -> str:
    """The name in :class:`ResNet` of a ``state_dict`` entry of the Sequential form
    (``stem.0.weight`` -> ``conv1.weight``, ``layer3_5.bn2.bias`` -> ``layer3.5.bn2.bias``)."""
    for prefix, replacement in _STEM.items():
        if sequential_key.startswith(prefix):
            return replacement + sequential_key.removeprefix(prefix)
    return _BLOCK.sub(r"layer\1.\2.", sequential_key)


def module_state(sequential_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Sequential form's ``state_dict`` renamed for :class:`ResNet` (same tensors)."""
    return {module_key(key): value for key, value in sequential_state.items()}
