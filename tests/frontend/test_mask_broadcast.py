"""Hugging Face's attention masks built by broadcasting while a model is traced: the same
shape, dtype, strides and values as transformers' ``torch.vmap`` builds, for every kind of mask
function it composes; swapped in only for the tracing thread, and only while it traces."""

import importlib
import sys
import threading

import pytest
import torch

from edgetrain.frontend.mask_broadcast import (
    MASKING_UTILS,
    broadcast_for_bhqkv,
    broadcasting_masks,
)
from edgetrain.models import thirdparty

pytest.importorskip("transformers")  # the zoo extra
thirdparty.transformers()
mu = importlib.import_module(MASKING_UTILS)  # loaded with any model that builds a mask

PADDING = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
FUNCTIONS = {
    "causal": mu.causal_mask_function,
    "causal, padded": mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(PADDING)),
    "sliding window, padded": mu.and_masks(
        mu.sliding_window_causal_mask_function(2), mu.padding_mask_function(PADDING)
    ),
    "chunked": mu.chunked_causal_mask_function(3, torch.tensor([0, 1])),
    "packed sequences": mu.and_masks(
        mu.causal_mask_function,
        mu.packed_sequence_mask_function(torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2, 2]])),
    ),
    "causal or a prefix": mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv < 2),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride())
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_mask_built_by_broadcasting_is_the_vmapped_mask(name):
    function = FUNCTIONS[name]
    indices = (torch.arange(2), torch.arange(1), torch.arange(6), torch.arange(6))
    with mu.TransformGetItemToIndex():
        _same(broadcast_for_bhqkv(function)(*indices), mu._vmap_for_bhqkv(function)(*indices))
    offset = (torch.arange(2), torch.arange(1), torch.arange(3, 6), torch.arange(6))  # decoding
    with mu.TransformGetItemToIndex():
        _same(broadcast_for_bhqkv(function)(*offset), mu._vmap_for_bhqkv(function)(*offset))


@pytest.mark.parametrize("name", ["causal", "causal or a prefix"])
def test_a_mask_over_queries_and_keys_only_is_the_vmapped_mask(name):
    function = FUNCTIONS[name]
    indices = (None, None, torch.arange(5), torch.arange(7))
    _same(
        broadcast_for_bhqkv(function, bh_indices=False)(*indices),
        mu._vmap_for_bhqkv(function, bh_indices=False)(*indices),
    )


def test_masks_are_broadcast_in_the_tracing_thread_only_and_only_while_it_traces():
    vmapped = mu._vmap_for_bhqkv
    elsewhere = []
    with broadcasting_masks():
        mine = mu._vmap_for_bhqkv(mu.causal_mask_function)
        other = threading.Thread(
            target=lambda: elsewhere.append(mu._vmap_for_bhqkv(mu.causal_mask_function))
        )
        other.start()
        other.join()
    assert mu._vmap_for_bhqkv is vmapped
    assert mine.__qualname__.startswith(broadcast_for_bhqkv.__qualname__)
    assert not elsewhere[0].__qualname__.startswith(broadcast_for_bhqkv.__qualname__)


def test_without_transformers_loaded_nothing_is_swapped(monkeypatch):
    monkeypatch.delitem(sys.modules, MASKING_UTILS)
    with broadcasting_masks():
        assert MASKING_UTILS not in sys.modules
    assert mu._vmap_for_bhqkv.__qualname__ == "_vmap_for_bhqkv"
