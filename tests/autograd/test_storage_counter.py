"""The live-storage counter counts exact tensor bytes, frees, backward, and meta tensors."""

from __future__ import annotations

import torch

from edgetrain.autograd.storage_counter import StorageCounter


def test_counts_new_storages_exactly_and_subtracts_freed_ones():
    with StorageCounter() as meter:
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(10, dtype=torch.float64)
        assert meter.live_bytes == 4000 + 80
        del a
        assert meter.live_bytes == 80
        del b
    assert meter.live_bytes == 0
    assert meter.peak_bytes == 4080


def test_views_and_in_place_results_are_not_new_memory():
    x = torch.zeros(100, 100)
    with StorageCounter() as meter:
        v = x[::2, :5]
        f = x.view(-1)
        x.add_(1.0)
        t = x.t()
    assert meter.peak_bytes == 0
    del v, f, t


def test_sees_the_backward_pass():
    w = torch.randn(64, 64, requires_grad=True)
    with StorageCounter() as meter:
        loss = (w @ w).sum()
        forward_peak = meter.peak_bytes
        loss.backward()
    assert forward_peak >= 64 * 64 * 4  # the product
    assert meter.peak_bytes > forward_peak  # gradient buffers of backward
    assert w.grad is not None


def test_works_on_meta_tensors_without_allocating():
    with StorageCounter() as meter:
        big = torch.empty(10**9, device="meta")
        doubled = big * 2
        del doubled
    assert meter.peak_bytes == 2 * 4 * 10**9
    del big
