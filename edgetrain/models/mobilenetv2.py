"""MobileNetV2 (Sandler et al. 2018) in torchvision's layout, built from code.

``features`` (a 3×3/2 stem, 17 inverted-residual blocks, a 1×1 convolution to 1280 channels),
global average pooling, and ``classifier`` (dropout 0.2, linear). An inverted residual expands
with a 1×1 convolution, filters depthwise 3×3, projects back with a linear 1×1 convolution, and
adds its input when stride and width allow. Activations are ``ReLU6(inplace=True)`` as in
torchvision. The residual addition lives in ``forward()``: the model is not a chain.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# (expansion t, output channels c, repeats n, first stride s): the paper's Table 2.
SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """Expand (1×1), depthwise (3×3), project (linear 1×1); input added when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        self.use_residual = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expansion != 1:
            layers.append(_conv_bn_relu6(cin, hidden, 1))
        layers += [
            _conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_residual:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 with width multiplier ``width`` (1.0 is the paper's network) and the
    inverted-residual stages of ``settings`` (rows of :data:`SETTINGS`; a prefix such as
    ``SETTINGS[:3]`` gives a shallower network of the same kinds of block)."""

    def __init__(
        self,
        num_classes: int = 1000,
        width: float = 1.0,
        dropout: float = 0.2,
        settings: tuple[tuple[int, int, int, int], ...] = SETTINGS,
    ) -> None:
        super().__init__()
        cin = _round(32 * width)
        last = _round(1280 * max(1.0, width))
        layers: list[nn.Module] = [_conv_bn_relu6(3, cin, 3, stride=2)]
        for t, c, n, s in settings:
            cout = _round(c * width)
            for i in range(n):
                layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        layers.append(_conv_bn_relu6(cin, last, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(x)


def _round(channels: float, divisor: int = 8) -> int:
    """Channels rounded to a multiple of ``divisor``, never below 90 % (torchvision's rule)."""
    rounded = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * channels else rounded
