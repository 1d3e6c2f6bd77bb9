"""A stage run again works on copies of its buffers; its graph keeps only the copies autograd
saved. An addition of a mask buffer saves nothing, so the copy goes when the run ends; a
BatchNorm's backward reads its running statistics, so its graph keeps their copies (not that of
``num_batches_tracked``). The prediction counts exactly that: measured peak = predicted."""

import copy

import pytest
import torch
from torch import nn

from edgetrain.core.schedule import Op, Schedule
from edgetrain.frontend.profiling import analytic_chain, profile_chain
from edgetrain.runtime.checkpointed import Checkpointed
from tests.helpers import same_state, step_peak

WIDTH, ROWS = 64, 32


class AddMask(nn.Module):
    """Adds a buffer as large as its input (an attention mask held by the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.randn(ROWS, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mask


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        AddMask(),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.BatchNorm1d(WIDTH),
        AddMask(),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        AddMask(),
        nn.Tanh(),
        nn.Linear(WIDTH, 1),
    )


def test_the_chain_counts_the_buffer_copies_a_graph_saves():
    x = torch.randn(ROWS, WIDTH)
    mask_bytes = ROWS * WIDTH * 4
    statistics = 2 * WIDTH * 4  # running_mean, running_var; num_batches_tracked is not saved
    for chain in (analytic_chain(model(), x), profile_chain(model(), x, repeats=1)):
        copied = [s.recompute_buffer_bytes for s in chain.stages]
        saved = [s.recompute_saved_buffer_bytes for s in chain.stages]
        assert copied == [0, mask_bytes, 0, 0, statistics + 8, mask_bytes, 0, 0, mask_bytes, 0, 0]
        assert saved == [0, 0, 0, 0, statistics, 0, 0, 0, 0, 0, 0]


PLAN = (
    "Fn0 Fn1 Fn2 Fn3 Fc4 Fn5 Fn6 Fn7 Fn8 Fa9 Fa10 B10 B9 "
    "Fa4 Fa5 Fa6 Fa7 Fa8 B8 B7 B6 B5 B4 Fa0 Fa1 Fa2 Fa3 B3 B2 B1 B0"
)
"""Every stage but the last two run again with grad: the masks and the BatchNorm included."""


def schedule(text: str, length: int) -> Schedule:
    codes = {op.code: op for op in Op}
    ops = [(codes[w.rstrip("0123456789")], int(w.lstrip("BDFPacinor"))) for w in text.split()]
    return Schedule.from_ops(length, ops)


def seeded(out: torch.Tensor) -> None:
    """The backward from a gradient of the output's size, as the prediction counts it."""
    out.backward(torch.ones_like(out))


@pytest.mark.parametrize("kept", [False, True], ids=["grads-none", "grads-kept"])
def test_a_recomputed_stage_holds_only_the_buffer_copies_its_graph_saves(kept):
    x = torch.randn(ROWS, WIDTH)
    plain = model()
    ours = copy.deepcopy(plain)
    chain = analytic_chain(ours, x)
    net = Checkpointed(ours, x, chain=chain, schedule=schedule(PLAN, chain.length))
    for _ in range(2):  # the first step creates the gradients the second keeps
        measured = step_peak(net, x, backward=seeded, kept=kept, params=list(ours.parameters()))
        step_peak(plain, x, backward=seeded, kept=kept)
    same_state(ours, plain)
    assert measured == net.cost.peak_bytes, net.runs_as
