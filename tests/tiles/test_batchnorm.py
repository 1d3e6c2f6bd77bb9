"""Global batch norm on one process equals nn.BatchNorm2d: output, gradients, running statistics.

(With several ranks it is checked end to end in test_tiles_exact.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edgetrain.tiles.batchnorm import global_batch_norm
from edgetrain.tiles.comm import Comm

WHOLE = (slice(None), slice(None))


def _pair(affine: bool = True, momentum: float | None = 0.1, dtype=torch.float64):
    torch.manual_seed(3)
    bn = nn.BatchNorm2d(6, affine=affine, momentum=momentum).to(dtype)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
    return bn, copy.deepcopy(bn)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_train_mode_matches_batchnorm2d_over_two_steps(affine, momentum):
    ours, theirs = _pair(affine, momentum)
    for step in range(2):
        x = (torch.randn(3, 6, 7, 5, dtype=torch.float64) * 2 + step).requires_grad_()
        grad = torch.randn(3, 6, 7, 5, dtype=torch.float64)
        y = global_batch_norm(x, ours, WHOLE, Comm.solo())
        (y * grad).sum().backward()
        dx = x.grad.clone()
        x.grad = None
        expected = theirs(x)
        (expected * grad).sum().backward()
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-12)
    if affine:
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=1e-12, atol=1e-12)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 2


def test_eval_mode_uses_running_statistics():
    ours, theirs = _pair()
    ours.eval()
    theirs.eval()
    x = torch.randn(2, 6, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(global_batch_norm(x, ours, WHOLE, Comm.solo()), theirs(x))
    assert int(ours.num_batches_tracked) == 0


def test_statistics_count_only_owned_pixels():
    """A halo column with wild values must not move the mean: only owned pixels count."""
    ours, theirs = _pair()
    owned = torch.randn(2, 6, 5, 4, dtype=torch.float64)
    halo = torch.full((2, 6, 5, 1), 1e3, dtype=torch.float64)
    y = global_batch_norm(
        torch.cat([owned, halo], 3), ours, (slice(None), slice(0, 4)), Comm.solo()
    )
    torch.testing.assert_close(y[..., :4], theirs(owned), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)


def test_float32_stays_within_rounding():
    ours, theirs = _pair(dtype=torch.float32)
    x = (torch.randn(2, 6, 32, 32) * 3 + 1).requires_grad_()
    grad = torch.randn(2, 6, 32, 32)
    y = global_batch_norm(x, ours, WHOLE, Comm.solo())
    (y * grad).sum().backward()
    dx, x.grad = x.grad.clone(), None
    (theirs(x) * grad).sum().backward()
    torch.testing.assert_close(dx, x.grad, rtol=1e-5, atol=1e-5)
