"""Sizing on meta tensors stands for the CPU's step, or is not used.

Chains from shapes (``analytic_chain``) and the plain-autograd step of every chain (the store-all
plan's peak) are sized on meta tensors. Three kinds of layer size there unlike the CPU:
``nn.LSTM``/``nn.GRU``/``nn.RNN`` (the CPU runs oneDNN's kernels: a 2-layer
LSTM's store-all plan would measure 1.79 × a meta prediction), ``mish`` (its backward
decomposes on meta: 1.78 × what a Mish MLP's store-all plan holds) and ``unfold``/``fold`` (the
CPU's ``col2im`` keeps its input's storage size). ``mish`` runs
on meta as on the CPU, the others are named (their meta step is not taken; ``analytic_chain``
refuses them with the fix), and a profiled chain takes its meta step only when its stages, sized
on meta, equal what was measured."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.core.simulator import simulate
from edgetrain.errors import InvalidInput
from edgetrain.frontend.profiling import analytic_chain, plain_step_peaks
from edgetrain.planners.optimal import minimum_memory, store_all
from edgetrain.runtime.checkpointed import Checkpointed


class Call(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class Recurrent(nn.Module):
    """A recurrent layer between two Linear layers, as sequence models write it."""

    def __init__(self, kind: type[nn.Module], **options) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.rnn = kind(32, 32, batch_first=True, **options)
        self.out = nn.Linear(32 * (2 if options.get("bidirectional") else 1), 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.rnn(F.gelu(self.inp(x)))[0]))


class Patches(nn.Module):
    """Convolution, then ``F.unfold`` into patches and a Linear over each (an involution-style
    layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.mix = nn.Linear(8 * 9, 16)
        self.out = nn.Linear(16 * 100, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(F.silu(self.conv(x)), 3, padding=1)
        return self.out(F.gelu(self.mix(patches.transpose(1, 2))).flatten(1))


def image() -> torch.Tensor:
    return torch.randn(2, 16, 12, 12, requires_grad=True)


def sequence() -> torch.Tensor:
    return torch.randn(2, 10, 16, requires_grad=True)


LAYERS = {
    "mish": (nn.Mish, image),
    "gelu-tanh": (lambda: nn.GELU("tanh"), image),
    "hardswish": (nn.Hardswish, image),
    "prelu": (lambda: nn.PReLU(16), image),
    "groupnorm": (lambda: nn.GroupNorm(4, 16), image),
    "instancenorm": (lambda: nn.InstanceNorm2d(16, affine=True), image),
    "rmsnorm": (lambda: nn.RMSNorm(16), sequence),
    "maxpool": (lambda: nn.MaxPool2d(2), image),
    "adaptive-max": (lambda: nn.AdaptiveMaxPool2d(3), image),
    "bilinear-up": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), image),
    "conv-transpose": (lambda: nn.ConvTranspose2d(16, 8, 2, stride=2), image),
    "depthwise": (lambda: nn.Conv2d(16, 16, 3, padding=1, groups=16), image),
    "pixel-shuffle": (lambda: nn.PixelShuffle(2), image),
    "channel-shuffle": (lambda: nn.ChannelShuffle(4), image),
    "dropout2d": (lambda: nn.Dropout2d(0.3), image),
    "reflection-pad": (lambda: nn.ReflectionPad2d(2), image),
    "encoder-layer": (lambda: nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), sequence),
    "lstm": (lambda: RecurrentOnly(nn.LSTM), sequence),
    "gru": (lambda: RecurrentOnly(nn.GRU), sequence),
    "rnn": (lambda: RecurrentOnly(nn.RNN), sequence),
    "unfold": (lambda: nn.Unfold(3), image),
    "fold": (
        lambda: Call(lambda x: F.fold(F.unfold(x, 2, stride=2), (12, 12), 2, stride=2)),
        image,
    ),
}
NOT_SIZED_ON_META = {"lstm", "gru", "rnn", "unfold", "fold"}


class RecurrentOnly(nn.Module):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = kind(16, 16, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_plain_step_sized_on_meta_is_the_cpus_or_is_not_given(name):
    make, sample = LAYERS[name]
    torch.manual_seed(0)
    model = nn.Sequential(make())
    x = sample()
    on_cpu = plain_step_peaks(model, x, meta=False)
    on_meta = plain_step_peaks(copy.deepcopy(model), x)
    if name in NOT_SIZED_ON_META:
        assert on_cpu is not None and on_meta is None
    else:
        assert on_meta == on_cpu


def plan_peaks(model: nn.Module, x: torch.Tensor, chain: edgetrain.Chain):
    """(predicted, measured) peak of one step at the least budget, half way and store-all."""
    least = minimum_memory(chain)
    # Budgets, as the planner's least memory, count the kernels' scratch (Cost.heap_peak_bytes).
    everything = simulate(chain, store_all(chain)).heap_peak_bytes
    for budget in (least, (least + everything) / 2, everything):
        ours = copy.deepcopy(model)
        schedule = edgetrain.plan(chain, "optimal", memory=budget)
        net = Checkpointed(ours, x, chain=chain, schedule=schedule)
        counter = StorageCounter()
        with counter:
            net(x).sum().backward()
        yield net.cost.peak_bytes, counter.peak_bytes


@pytest.mark.parametrize(
    "make",
    [
        lambda: Recurrent(nn.LSTM, num_layers=2),
        lambda: Recurrent(nn.LSTM, bidirectional=True),
        lambda: Recurrent(nn.GRU),
    ],
    ids=["lstm-2-layers", "lstm-bidirectional", "gru"],
)
def test_recurrent_models_hold_their_plans_and_are_not_sized_from_shapes(make):
    torch.manual_seed(0)
    model, x = make(), torch.randn(4, 30, 8)
    chain = Checkpointed(copy.deepcopy(model), x).chain
    for predicted, measured in plan_peaks(model, x, chain):
        assert 0.95 * predicted <= measured <= predicted
    with pytest.raises(InvalidInput, match=r"cannot be sized from shapes: its nn\.(LSTM|GRU)"):
        analytic_chain(model, x)


def test_a_model_with_unfold_holds_its_plans_and_is_not_sized_from_shapes():
    torch.manual_seed(0)
    model, x = Patches(), torch.randn(4, 3, 10, 10)
    chain = Checkpointed(copy.deepcopy(model), x).chain
    for predicted, measured in plan_peaks(model, x, chain):
        assert 0.95 * predicted <= measured <= predicted
    with pytest.raises(InvalidInput, match=r"its F\.unfold holds other sizes .* profile it"):
        analytic_chain(model, x)


def test_a_mish_mlp_is_sized_from_shapes_as_it_runs():
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(64, 64), nn.Mish())]
    model, x = nn.Sequential(*layers, nn.Linear(64, 4)), torch.randn(64, 64)
    measured_chain = Checkpointed(copy.deepcopy(model), x).chain
    shapes_chain = analytic_chain(model, x)
    assert shapes_chain.fingerprint() == measured_chain.fingerprint()
    assert shapes_chain.autograd_peak_bytes == measured_chain.autograd_peak_bytes
    for predicted, measured in plan_peaks(model, x, shapes_chain):
        assert 0.95 * predicted <= measured <= predicted
