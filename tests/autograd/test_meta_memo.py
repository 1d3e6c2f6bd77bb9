"""MetaMemo stamps out repeated meta calls without changing a byte the storage counter sees."""

from __future__ import annotations

import torch
from torch import nn

from edgetrain.autograd import meta_memo
from edgetrain.autograd.meta_memo import MetaMemo
from edgetrain.autograd.storage_counter import StorageCounter


class _Block(nn.Module):
    """Views, in-place ops, a reshape of a transpose (``_unsafe_view``), attention, a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.bn = nn.BatchNorm1d(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = x + self.attn(h, h, h, need_weights=False)[0]
        t = self.bn(h.transpose(1, 2)).transpose(1, 2).reshape(-1, 16)
        return torch.relu_(self.fc(t)).view_as(h) + h


def _step_peaks(model: nn.Module, x: torch.Tensor, memo: bool) -> list[int]:
    peaks = []
    for _ in range(2):  # the second step repeats every call of the first
        counter = StorageCounter()
        with MetaMemo() if memo else torch.enable_grad(), counter:
            out = model(x)
            out.square().mean().backward()
            del out
        peaks.append(counter.peak_bytes)
        for p in model.parameters():
            p.grad = None
    return peaks


def test_stamped_calls_hold_the_bytes_the_kernels_make() -> None:
    model = nn.Sequential(_Block(), _Block()).to("meta")
    x = torch.empty(3, 5, 16, device="meta", requires_grad=True)
    meta_memo.forget()
    plain = _step_peaks(model, x, memo=False)
    stamped = _step_peaks(model, x, memo=True)
    assert stamped == plain
    assert meta_memo._known, "the memo remembered no call"


def test_views_and_in_place_results_are_never_stamped() -> None:
    meta_memo.forget()
    x = torch.empty(4, 6, device="meta")
    with MetaMemo():
        for _ in range(2):
            v = x.transpose(0, 1)
            r = x.reshape(24)
            y = x.add_(1)
            assert v.untyped_storage()._cdata == x.untyped_storage()._cdata
            assert r.untyped_storage()._cdata == x.untyped_storage()._cdata
            assert y is x
