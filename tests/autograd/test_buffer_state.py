"""Stages whose result depends on buffer state their own forward changes, and stages that keep
a tensor they compute, the way users write them: ``spectral_norm`` (torch's parametrization,
and the older hook that sets the weight it computes as an attribute) in an MLP and in a
GAN-style discriminator, the older ``weight_norm`` hook, and an exponential moving average a
module assigns itself.

A recomputation that ran spectral norm's power iteration again from the vectors the first run
updated would use another weight and give gradients unlike plain autograd's; the hooks' weights,
kept by the modules until the next forward, must be counted (uncounted, the tightest plan on six
such layers holds 98 KB above its plan and budget, 2.4 × the plan with ``weight_norm``); and
profiling a model that assigns itself a buffer must leave it as it was.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch import nn
from torch.nn.utils import spectral_norm as hook_spectral_norm
from torch.nn.utils.parametrizations import spectral_norm

import edgetrain
from edgetrain.core.chain import Chain, Stage
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import memory_trace, simulate
from edgetrain.frontend.profiling import analytic_chain, profile_chain
from edgetrain.planners.optimal import store_all
from edgetrain.planners.search import least_memory_of
from edgetrain.runtime.checkpointed import Checkpointed
from tests.helpers import step_peak

# The caller's loss (a sum of squares of a 64 × 10 or 4 × 1 output): its squares and scalar.
LOSS_BYTES = 64 * 10 * 4 + 8


class Ema(nn.Module):
    """Subtracts a running mean of its inputs that it assigns itself anew at every call."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0).detach()
        return x - self.mean


class BatchStatistics(nn.Module):
    """Updates a running mean in place, as BatchNorm does, and normalises with the batch's own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - x.mean(0)


def hook_weight_norm(module: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still widely used
        return nn.utils.weight_norm(module)


def mlp(norm) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [norm(nn.Linear(64, 64)), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 10))


class Discriminator(nn.Module):
    """A small GAN discriminator with residual connections (captured with torch.fx)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = spectral_norm(nn.Conv2d(3, 16, 3, padding=1))
        self.body = nn.ModuleList(spectral_norm(nn.Conv2d(16, 16, 3, padding=1)) for _ in range(2))
        self.act = nn.LeakyReLU(0.2)
        self.head = spectral_norm(nn.Linear(16 * 8 * 8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.stem(x))
        for conv in self.body:
            h = h + self.act(conv(h))
        return self.head(h.flatten(1))


def ema_net() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.SiLU(), Ema(64)) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(64, 10))


def discriminator() -> Discriminator:
    torch.manual_seed(0)
    return Discriminator()


def models() -> dict[str, tuple[Callable[[], nn.Module], torch.Tensor]]:
    """Factories (the hooks' weights are not leaves: such a model cannot be deep-copied)."""
    torch.manual_seed(1)
    x = torch.randn(64, 64)
    return {
        "parametrized": (partial(mlp, spectral_norm), x),
        "hook": (partial(mlp, hook_spectral_norm), x),
        "weight_norm_hook": (partial(mlp, hook_weight_norm), x),
        "discriminator": (discriminator, torch.randn(4, 3, 8, 8)),
        "ema": (ema_net, x),
    }


def test_flow_finds_the_stages_that_read_buffers_they_change():
    torch.manual_seed(0)
    model = nn.Sequential(
        spectral_norm(nn.Linear(16, 16)),  # power iteration: u, v read and updated
        nn.BatchNorm1d(16),  # updates its statistics, normalises with the batch's
        Ema(16),
        BatchStatistics(16),
        nn.Linear(16, 16),
    )
    x = torch.randn(8, 16)
    expected = [True, False, True, False, False]
    for chain in (profile_chain(model, x, repeats=1), analytic_chain(model, x)):
        assert [s.reads_updated_buffers for s in chain.stages] == expected
    model.eval()  # no power iteration in eval; the moving average still moves
    flags = [s.reads_updated_buffers for s in profile_chain(model, x, repeats=1).stages]
    assert flags == [False, False, True, False, False]


@pytest.mark.parametrize("name", ["hook", "weight_norm_hook"])
def test_the_hooks_weight_is_what_the_stage_retains(name):
    build, x = models()[name]
    chain = profile_chain(build(), x, repeats=1)
    weight = 64 * 64 * 4
    assert [s.retained_bytes for s in chain.stages[:12:2]] == [weight] * 6
    assert not any(s.retained_bytes for s in chain.stages[1::2])
    assert all(s.output_bytes == 64 * 64 * 4 for s in chain.stages[:12])
    clean = profile_chain(mlp(lambda m: m), x, repeats=1)
    assert not any(s.retained_bytes for s in clean.stages)


@pytest.mark.parametrize("name", list(models()))
@pytest.mark.parametrize("kept", [False, True])
def test_recomputed_stages_match_plain_autograd_and_hold_their_budget(name, kept):
    build, x = models()[name]
    chain = Checkpointed(build(), x).chain
    flagged = {k for k, s in enumerate(chain.stages) if s.reads_updated_buffers}
    assert flagged or any(s.retained_bytes for s in chain.stages)
    # Budgets hold the kernels' scratch too: the smallest is the one edgetrain.plan takes.
    least = least_memory_of(chain, grads_exist=kept)
    everything = simulate(chain, store_all(chain), grads_exist=kept).heap_peak_bytes
    reran = set()
    for budget in (least, (least + everything) / 2, everything):
        plain = build()
        step_peak(plain, x, kept=kept, params=list(plain.parameters()))
        ours = build()
        schedule = edgetrain.plan(chain, "optimal", memory=budget, grads_exist=kept)
        forwards = [k for kind, k in schedule if kind.is_forward]
        reran |= {k for k in flagged if forwards.count(k) > 1}
        run = Checkpointed(ours, x, chain=chain, schedule=schedule)
        measured = step_peak(run, x, kept=kept, params=list(ours.parameters()))
        for a, b in zip(plain.parameters(), ours.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (budget, schedule.text())
        for a, b in zip(plain.buffers(), ours.buffers(), strict=True):
            assert torch.equal(a, b), budget
        assert run.cost.peak_bytes <= budget + 1
        assert measured <= run.cost.peak_bytes + LOSS_BYTES, (budget, run.runs_as)
    assert reran or not flagged, "no plan ran a stage that reads its updated buffers again"


def parse(text: str, length: int) -> Schedule:
    codes = {op.code: op for op in Op}
    ops = [(codes[w.rstrip("0123456789")], int(w.lstrip("BDFPacinor"))) for w in text.split()]
    return Schedule.from_ops(length, ops)


def test_simulator_holds_the_snapshot_from_the_first_run_to_the_last():
    def stage(**extra: object) -> Stage:
        return Stage("s", 100, 0, True, 100, 100, 200, 0, 0, 1.0, 1.0, **extra)  # type: ignore[arg-type]

    snap = 7
    plain = Chain(stages=(stage(), stage(), stage()), input_bytes=100)
    flagged = Chain(
        stages=(stage(), stage(reads_updated_buffers=True, buffer_bytes=snap), stage()),
        input_bytes=100,
    )
    schedule = parse("Fc0 Fn1 Fa2 B2 Fa0 Fa1 B1 B0", 3)
    base = memory_trace(plain, schedule)
    traced = memory_trace(flagged, schedule)
    # Held from Fn1 (taken before it) through Fa1 (whose copies it makes); a copy during the
    # run again, and in its graph until B1.
    extra = [after - before for (_, _, before), (_, _, after) in zip(base, traced, strict=True)]
    assert extra == [0, snap, snap, snap, snap, snap, 0, 0]
    # A stage that runs once takes none.
    once = parse("Fa0 Fa1 Fa2 B2 B1 B0", 3)
    assert memory_trace(flagged, once) == memory_trace(plain, once)


def test_simulator_counts_what_a_stage_retains_once_to_the_end():
    def stage(retained: int = 0) -> Stage:
        return Stage("s", 100, 0, True, 100 + retained, 100 + retained, 200, 0, 0, 1.0, 1.0,
                     retained_bytes=retained)  # fmt: skip

    chain = Chain(stages=(stage(), stage(50), stage()), input_bytes=100)
    schedule = parse("Fc0 Fn1 Fa2 B2 Fa0 Fa1 B1 B0", 3)
    plain = Chain(stages=(stage(), stage(), stage()), input_bytes=100)
    held = [after for _, _, after in memory_trace(chain, schedule)]
    base = [after for _, _, after in memory_trace(plain, schedule)]
    assert [a - b for a, b in zip(held, base, strict=True)] == [0, 50, 50, 50, 50, 50, 50, 50]


@pytest.mark.parametrize("name", ["hook", "weight_norm_hook"])
def test_a_model_with_a_hooks_weight_is_sized_from_shapes_as_measured(name):
    """The hook's weight is not a leaf, which deepcopy refuses: the meta copy maps it too."""
    build, x = models()[name]
    model = build()
    model(x)  # the hooks have set the weights they compute
    assert (
        analytic_chain(model, x).fingerprint() == profile_chain(model, x, repeats=1).fingerprint()
    )
