"""Buffers that view one storage (the constants capture makes of one tensor a model computes
once and reads in two layers, as GPT-2's attention mask) are held once: the chain's fixed
buffers count them once, sized on the device or on meta tensors."""

import torch
from torch import nn

from edgetrain.frontend.profiling import analytic_chain, profile_chain

ROWS, WIDTH = 16, 32


class AddMask(nn.Module):
    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mask


def test_buffers_viewing_one_storage_are_counted_once():
    mask = torch.randn(ROWS, WIDTH)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        AddMask(mask.view(ROWS, WIDTH)),  # two tensors, one storage
        nn.Linear(WIDTH, WIDTH),
        AddMask(mask.view(ROWS, WIDTH)),
        nn.Linear(WIDTH, WIDTH),
        AddMask(torch.randn(ROWS, WIDTH)),  # a storage of its own
    )
    x = torch.randn(ROWS, WIDTH)
    mask_bytes = ROWS * WIDTH * 4
    for chain in (analytic_chain(model, x), profile_chain(model, x, repeats=1)):
        assert chain.buffer_bytes == 2 * mask_bytes
        # A run again copies each stage's own: the copies are not shared.
        assert [s.recompute_buffer_bytes for s in chain.stages[1::2]] == [mask_bytes] * 3
