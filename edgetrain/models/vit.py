"""A small Vision Transformer encoder (Dosovitskiy et al. 2021) with a classification head.

Patch embedding (a ``patch``×``patch`` convolution with that stride), a class token, learned
position embeddings, ``depth`` pre-norm transformer blocks (:mod:`edgetrain.models.transformer`:
LayerNorm, multi-head attention, GELU MLP), a final LayerNorm, and a linear head on the class
token. The defaults are ViT-Tiny/16 (dim 192, 12 blocks, 3 heads) at 224². The position
embeddings fix the image size at construction.
"""

from __future__ import annotations

import torch
from torch import nn

from edgetrain.models.transformer import Block


class ViT(nn.Module):
    """ViT encoder for square ``image_size`` images cut into ``patch``² patches."""

    def __init__(
        self,
        image_size: int = 224,
        patch: int = 16,
        dim: int = 192,
        depth: int = 12,
        heads: int = 3,
        num_classes: int = 1000,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image size {image_size} is not a multiple of the patch {patch}")
        tokens = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (batch, tokens, dim)
        cls = self.cls_token.expand(x.size(0), -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])
