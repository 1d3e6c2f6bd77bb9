"""The classifier the teacher and the student share: a small CNN written as ``nn.Sequential``.

Four convolution blocks (convolution, BatchNorm, ReLU, max-pool) and a head; each block is one
child, so :class:`edgetrain.Checkpointed` plans over five stages. Inputs are ``INPUT`` x ``INPUT``
crops scaled to [-0.5, 0.5].
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

INPUT = 64  # side of the classifier's input, pixels


def classifier(classes: int, width: int = 16) -> nn.Sequential:
    """The CNN: 3 -> width -> 2w -> 4w -> 8w channels, then global pooling and a linear layer."""

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )

    w = width
    return nn.Sequential(
        block(3, w),
        block(w, 2 * w),
        block(2 * w, 4 * w),
        block(4 * w, 8 * w),
        nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(8 * w, classes)
        ),
    )


def to_input(crops: list[np.ndarray] | np.ndarray) -> torch.Tensor:
    """uint8 crops (N x INPUT x INPUT x 3) to the float input (N x 3 x INPUT x INPUT)."""
    array = np.ascontiguousarray(np.stack(list(crops)) if isinstance(crops, list) else crops)
    return torch.from_numpy(array).permute(0, 3, 1, 2).float().div(255.0).sub(0.5)
