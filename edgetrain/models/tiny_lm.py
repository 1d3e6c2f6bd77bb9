"""A small GPT-style language model whose output layer shares the token embedding (tied weights).

Token and learned position embeddings, ``depth`` causal pre-norm transformer blocks
(:mod:`edgetrain.models.transformer`), a final LayerNorm, and a linear head onto the vocabulary
whose weight *is* the embedding matrix (``head.weight = embed.weight``, as nanoGPT and GPT-2 do):
one parameter used by two modules, its gradient the sum of both uses. Input: token ids of shape
(batch, sequence) with sequence ≤ ``context``; output: logits (batch, sequence, vocab).
"""

from __future__ import annotations

import torch
from torch import nn

from edgetrain.models.transformer import Block


class TinyLM(nn.Module):
    """Causal transformer language model with the embedding tied to the output layer."""

    def __init__(
        self, vocab: int = 4096, context: int = 256, dim: int = 256, depth: int = 6, heads: int = 4
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos_embed = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads, causal=True) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(self.embed.weight, 0, 0.02)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos_embed[: tokens.size(1)]
        return self.head(self.norm(self.blocks(x)))
