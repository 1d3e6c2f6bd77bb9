"""A pre-norm transformer block (LayerNorm, multi-head attention, LayerNorm, GELU MLP), shared
by the ViT encoder and the tied-embedding language model.

Attention is written out (one linear layer for queries, keys and values, reshaped into heads,
``scaled_dot_product_attention``, an output projection) so that a graph capture sees its
operations. Shapes are taken from the block's own sizes, never from a tensor's value.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    """Multi-head self-attention over a (batch, tokens, dim) sequence; causal if asked."""

    def __init__(self, dim: int, heads: int, causal: bool = False) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, tokens, 3 * dim) -> (3, batch, heads, tokens, head_dim)
        qkv = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=self.causal)
        return self.proj(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)) with a GELU MLP of ``mlp_ratio`` × dim."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, causal: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
