"""Claims checked against references that share no code with what they check.

Each test here catches a bug injected into that claim's code that the rest of the suite
does not notice (``scripts/mutate.py`` injects them again and reports which are caught):

* planners: the least memory within a recompute factor, against every knob value simulated
  (sequential, revolve) or against the exhaustive search of :mod:`tests.exhaustive` (optimal, the
  trade-off curve, the dynamic-programming table alone, without the plans ``optimal()`` adds),
  always at budgets where checkpointing matters;
* memory accounting: the fixed terms against the storages a real step starts with, the activation
  term against a real step measured with ``StorageCounter``, within 1 %;
* ``Checkpointed`` under ``no_grad`` or with nothing to train: holds what plain inference holds;
* the memory table: red cells are exactly the rows whose ``--json`` ``fits`` is false;
* profiling: a stage's time is the median of its timed runs, on a stage whose durations are known.
"""

from __future__ import annotations

import io
import json
import math
import random
import re
import threading
import time

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from torch import nn

from edgetrain.autograd.storage_counter import StorageCounter, storage_bytes
from edgetrain.core.accounting import fixed_training_bytes
from edgetrain.core.chain import Chain, uniform_chain
from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget
from edgetrain.frontend.profiling import analytic_chain, profile_chain
from edgetrain.models import model_chain
from edgetrain.models.resnet import BasicBlock
from edgetrain.paper.measured_step import measure_training_step
from edgetrain.paper.memory_model import autograd_estimate
from edgetrain.planners import plan
from edgetrain.planners.optimal import OptimalTable
from edgetrain.planners.revolve import revolve
from edgetrain.planners.search import tradeoff
from edgetrain.planners.sequential import sequential
from edgetrain.runtime.checkpointed import Checkpointed
from tests.conftest import random_chain, small_cnn
from tests.exhaustive import fastest_schedule

TOLERANCE = 1e-9

# -- references ----------------------------------------------------------------------------------


def exhaustive_times(chain: Chain, *, release: bool = False) -> list[float]:
    """``times[b]``: the least time of any schedule within ``b`` bytes (Dijkstra over all
    schedules; rotor's class, or with ``release`` every nested one, with ``Fr`` and checkpoints
    dropped before their backward too), for every budget from 0 up to the first that allows
    plain autograd's time."""
    plain = chain.forward_seconds + chain.backward_seconds
    times: list[float] = []
    budget = 0
    while not times or times[-1] > plain * (1 + TOLERANCE):
        times.append(fastest_schedule(chain, budget, release=release, persistent=not release)[0])
        budget += 1
    return times


def least_budget(times: list[float], seconds: float) -> int:
    """The fewest bytes with which some schedule takes at most ``seconds``."""
    return next(b for b, t in enumerate(times) if t <= seconds * (1 + TOLERANCE))


def pareto(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """(factor, bytes) points each using less memory than every faster one, sorted by factor."""
    front: list[tuple[float, int]] = []
    for rho, peak in sorted(points):
        if not front or peak < front[-1][1]:
            front.append((rho, peak))
    return front


FAMILIES = {"sequential": sequential, "revolve": revolve}


# -- planners: least memory within a factor, fastest within a budget ----------------------------


# Five-stage random chains; tests/exhaustive.py searches the dynamic program's class of schedules
# (nested: no stage runs forward while a later stage's graph is held; persistent: a checkpoint
# held across a backward stays until its own stage's Fa).
EXACT = {seed: random_chain(random.Random(seed), 5) for seed in (0, 1, 2, 3, 4, 5, 13, 29, 31, 39)}


@pytest.mark.parametrize("seed", sorted(EXACT))
@pytest.mark.parametrize("rho", [1.05, 1.2, 1.5, 2.0, 3.0])
def test_optimal_recompute_search_needs_at_most_rotors_least_memory(seed, rho):
    """No more than rotor's least (exhaustive over rotor's schedules), no less than the least of
    any schedule with ``Fr`` (the release start is one of those)."""
    chain = EXACT[seed]
    plain = chain.forward_seconds + chain.backward_seconds
    least = least_budget(exhaustive_times(chain), rho * plain)
    possible = least_budget(exhaustive_times(chain, release=True), rho * plain)
    cost = simulate(chain, plan(chain, "optimal", max_recompute=rho))
    assert cost.recompute_factor <= rho + TOLERANCE
    assert possible <= cost.peak_bytes <= least


@pytest.mark.parametrize("rho", [1.5, 2.0, 3.0])
def test_optimal_recompute_search_on_a_uniform_chain_beats_storing_everything(rho):
    # 6 equal stages: at factor 1.5 or more a plan stores far less than everything.
    chain = uniform_chain(6)
    least = least_budget(exhaustive_times(chain), rho * 12)
    cost = simulate(chain, plan(chain, "optimal", max_recompute=rho))
    assert cost.peak_bytes == least
    assert least < simulate(chain, sequential(chain, 1)).peak_bytes


def family_costs(chain: Chain, strategy: str):
    return [simulate(chain, FAMILIES[strategy](chain, k)) for k in range(1, chain.length + 1)]


TEST_CHAINS = {
    "random12": random_chain(random.Random(3), 12, scale=40),
    "random9": random_chain(random.Random(17), 9, scale=25),
    "uniform20": uniform_chain(20, activation_bytes=100),
}


@pytest.mark.parametrize("chain_name", sorted(TEST_CHAINS))
@pytest.mark.parametrize("strategy", sorted(FAMILIES))
@pytest.mark.parametrize("rho", [1.2, 1.5, 2.0, 3.0])
def test_family_recompute_search_picks_the_least_memory_within_the_factor(
    chain_name, strategy, rho
):
    chain = TEST_CHAINS[chain_name]
    within = [c for c in family_costs(chain, strategy) if c.recompute_factor <= rho + TOLERANCE]
    if not within:
        with pytest.raises(InfeasibleBudget):
            plan(chain, strategy, max_recompute=rho)
        return
    cost = simulate(chain, plan(chain, strategy, max_recompute=rho))
    assert cost.recompute_factor <= rho + TOLERANCE
    assert cost.peak_bytes == min(c.peak_bytes for c in within)


@pytest.mark.parametrize("chain_name", sorted(TEST_CHAINS))
@pytest.mark.parametrize("strategy", sorted(FAMILIES))
def test_family_memory_search_picks_the_fastest_that_fits(chain_name, strategy):
    chain = TEST_CHAINS[chain_name]
    costs = family_costs(chain, strategy)
    low, high = min(c.peak_bytes for c in costs), max(c.peak_bytes for c in costs)
    for budget in sorted({low, (low + high) // 2, (low + 3 * high) // 4, high}):
        fitting = [c for c in costs if c.peak_bytes <= budget]
        cost = simulate(chain, plan(chain, strategy, memory=budget))
        assert cost.peak_bytes <= budget
        assert cost.seconds == pytest.approx(min(c.seconds for c in fitting))


@pytest.mark.parametrize("seed", sorted(EXACT))
def test_optimal_tradeoff_curve_reaches_rotors_exhaustive_front_with_possible_points(seed):
    chain = EXACT[seed]
    plain = chain.forward_seconds + chain.backward_seconds
    times = exhaustive_times(chain)
    possible = exhaustive_times(chain, release=True)
    front = pareto([(t / plain, b) for b, t in enumerate(times) if math.isfinite(t)])
    curve = tradeoff(chain, "optimal")
    for rho, _ in front:  # every point of rotor's front is on the curve or beaten ...
        least = least_budget(times, rho * plain)  # (factors equal up to rounding count as one)
        assert min(p for r, p in curve if r <= rho * (1 + TOLERANCE)) <= least, (rho, least)
    for rho, peak in curve:  # ... and every point of the curve can be had
        assert least_budget(possible, rho * plain) <= peak, (rho, peak)


def assert_table_is_the_exhaustive_optimum(chain: Chain) -> None:
    # No fallback plans here: the table is built and read directly, at every budget between the
    # least any schedule needs and the least that allows plain autograd's time.
    times = exhaustive_times(chain)
    smallest = next(b for b, t in enumerate(times) if math.isfinite(t))
    everything = len(times) - 1
    assert smallest < everything  # checkpointing matters on these chains
    table = OptimalTable(chain, 1.0, everything + 1, release=False)  # rotor's recursion
    assert math.isinf(table.time(smallest - 1))
    for budget in range(smallest, everything + 1):
        assert table.time(budget) == pytest.approx(times[budget], rel=1e-9), budget
        cost = simulate(chain, table.schedule(budget))
        assert cost.peak_bytes <= budget
        assert cost.seconds == pytest.approx(times[budget], rel=1e-9)


@pytest.mark.parametrize("seed", sorted(EXACT))
def test_dp_table_alone_equals_brute_force_where_checkpointing_matters(seed):
    assert_table_is_the_exhaustive_optimum(EXACT[seed])


# -- memory accounting against a real step ------------------------------------------------------


class PixelNormalize(nn.Module):
    """Subtract a dataset's per-pixel mean image, divide by its per-pixel deviation (buffers)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.rand(shape))
        self.register_buffer("std", torch.rand(shape) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def small_resnet(blocks: int = 3, width: int = 8) -> nn.Sequential:
    """A narrow ResNet on 32 x 32 images: activations are most of what training holds, and the
    normalisation buffers and the input are each a few percent of it."""
    torch.manual_seed(0)
    stem = nn.Sequential(PixelNormalize((3, 32, 32)), nn.Conv2d(3, width, 3, padding=1))
    return nn.Sequential(
        stem,
        *(BasicBlock(width, width) for _ in range(blocks)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


def measured_step(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(bytes held before a step, most bytes the step holds above them), after one Adam step so
    that gradients and optimizer state exist; plain autograd, the user's loop."""
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    model(x).sum().backward()
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    # Adam's step counters (one scalar per parameter) are not state per parameter element.
    state = [v for v in state if v.dim() > 0]
    before = storage_bytes([*params, *(p.grad for p in params), *state, *model.buffers(), x])
    counter = StorageCounter()
    with counter:
        out = model(x)
        out.sum().backward()
        del out
    return before, counter.peak_bytes


def test_fixed_training_bytes_are_what_a_step_starts_with():
    model = small_resnet()
    x = torch.randn(2, 3, 32, 32)
    chain = analytic_chain(model, x)
    params = list(model.parameters())
    grads = [torch.zeros_like(p) for p in params]
    held = storage_bytes([*params, *grads, *model.buffers(), x])
    assert fixed_training_bytes(chain, "sgd") == held
    momentum = storage_bytes([torch.zeros_like(p) for p in params])
    assert fixed_training_bytes(chain, "momentum") == held + momentum
    # The buffers and the input are a real part of it here (a bug dropping them shows).
    assert chain.buffer_bytes > 0.1 * held and chain.input_bytes > 0.1 * held


def test_autograd_estimate_fixed_terms_are_what_a_step_starts_with():
    x = torch.randn(2, 3, 32, 32)
    estimate = autograd_estimate(analytic_chain(small_resnet(), x), "adam")
    before, _ = measured_step(small_resnet(), x)
    fixed = estimate.total_bytes - estimate.activations_bytes - estimate.activation_gradients_bytes
    assert fixed == pytest.approx(before, rel=0.01)
    assert fixed > 0 and before > 0


def test_autograd_estimate_of_resnet18_is_within_1_percent_of_a_measured_step():
    # Activations are 6 % of this step (weights and Adam state dominate): 1 %, not 10 %, so that
    # losing any term of the estimate shows.
    estimate = autograd_estimate(model_chain("resnet18", 2, 64, timing=False), "adam")
    measured = measure_training_step("resnet18", 2, 64, "adam")
    assert estimate.total_bytes == pytest.approx(measured, rel=0.01)
    assert estimate.activations_bytes > 0.03 * measured


@pytest.mark.parametrize("batch", [1, 2])
def test_autograd_estimate_is_within_1_percent_where_activations_dominate(batch):
    x = torch.randn(batch, 3, 32, 32)
    chain = analytic_chain(small_resnet(), x)
    estimate = autograd_estimate(chain, "adam")
    before, peak = measured_step(small_resnet(), x)
    total = before + peak
    assert peak > 0.5 * total  # activations dominate
    assert chain.buffer_bytes > 0.015 * total and chain.input_bytes > 0.015 * total
    assert estimate.total_bytes == pytest.approx(total, rel=0.01)
    assert estimate.activations_bytes == pytest.approx(peak, rel=0.01)


# -- Checkpointed when nothing is trained ---------------------------------------------------------


def peak_of(fn, x: torch.Tensor) -> int:
    counter = StorageCounter()
    with counter:
        out = fn(x)
        del out
    return counter.peak_bytes


@pytest.mark.parametrize(
    ("strategy", "budget"),
    [("optimal", {}), ("optimal", {"max_recompute": 1.5}), ("sequential", {"max_recompute": 2.0})],
)
def test_inference_under_no_grad_holds_what_plain_inference_holds(strategy, budget):
    model = small_cnn(torch.float32)
    x = torch.randn(4, 3, 8, 8)
    net = Checkpointed(model, x, chain=analytic_chain(model, x), strategy=strategy, **budget)
    for train in (True, False):
        model.train(train)
        with torch.no_grad():
            torch.manual_seed(0)
            plain = peak_of(model, x)
            torch.manual_seed(0)
            ours = peak_of(net, x)
        assert ours == plain, f"train={train}"


def test_a_frozen_model_holds_what_plain_inference_holds():
    model = small_cnn(torch.float32)
    x = torch.randn(4, 3, 8, 8)
    net = Checkpointed(model, x, chain=analytic_chain(model, x), max_recompute=1.0)
    model.requires_grad_(False)  # feature extraction: nothing to train, grad mode still on
    model.eval()
    out = net(x)
    assert not out.requires_grad
    assert peak_of(net, x) == peak_of(model, x)


# -- the memory table ---------------------------------------------------------------------------

RED = r"\x1b\[(?:[0-9]+;)*31(?:;[0-9]+)*m\s*"  # an ANSI style that sets the foreground red


def test_memory_table_marks_in_red_exactly_the_rows_above_the_device(monkeypatch):
    from edgetrain.cli import memory as memory_command
    from edgetrain.cli.main import cli

    args = ["memory", "--models", "resnet18", "--batch", "1,3,5,10", "--memory", "400MiB"]
    result = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    data = json.loads(result.stdout)
    rows = data["rows"]
    for row in rows:
        assert row["fits"] == (row["total_bytes"] <= data["device_memory_bytes"]), row
    assert any(r["fits"] for r in rows) and not all(r["fits"] for r in rows)

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, color_system="standard", width=200)
    monkeypatch.setattr(memory_command, "console", console)
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0
    lines = [line for line in screen.getvalue().splitlines() if "resnet18" in line]
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows, strict=True):
        total_mib = f"{row['total_bytes'] / 2**20:.2f}"  # the table is in MiB
        red = re.search(RED + re.escape(total_mib), line)
        assert (red is not None) == (not row["fits"]), (row, line)


# -- profiling times ------------------------------------------------------------------------------


def _spin(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` of its CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


class _Busy(torch.autograd.Function):
    """y = x * w; the forward and the backward each spin as their schedules say."""

    @staticmethod
    def forward(ctx, x, weight, clock):  # type: ignore[override]
        _spin(clock.next("forward"))
        ctx.save_for_backward(x, weight)
        ctx.clock = clock
        return x * weight

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        _spin(ctx.clock.next("backward"))
        return grad * weight, (grad * x).sum(0), None


class BusyScale(nn.Module):
    """A stage whose every third forward and every third backward is fast, the others slow
    (busy, in CPU time): any run of five has one or two fast ones, so their median is slow and
    their least fast."""

    FAST = 0.002
    SLOW = 0.05

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.calls = {"forward": 0, "backward": 0}
        self.lock = threading.Lock()

    def next(self, kind: str) -> float:
        with self.lock:
            self.calls[kind] += 1
            return self.FAST if self.calls[kind] % 3 == 0 else self.SLOW

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            _spin(self.next("forward"))
            return x * self.weight
        return _Busy.apply(x, self.weight, self)


class Waits(nn.Module):
    """A stage that waits (sleeps, using no CPU) before it multiplies: what another job on the
    machine looks like to a wall clock."""

    WAIT = 0.05

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.WAIT)
        return x * self.weight


def test_profiled_times_are_the_least_cpu_time_of_the_timed_runs():
    model = nn.Sequential(nn.Linear(4, 4), BusyScale(4))
    chain = profile_chain(model, torch.randn(3, 4), repeats=5)
    stage = chain.stages[1]
    assert model[1].calls["forward"] >= 5 and model[1].calls["backward"] >= 5
    fast, slow = BusyScale.FAST, BusyScale.SLOW
    assert fast <= stage.forward_seconds < (fast + slow) / 8
    assert fast <= stage.backward_seconds < (fast + slow) / 8


def test_profiled_times_do_not_count_waiting():
    # Time spent off the CPU (here asleep; on a shared machine, other jobs running) is not the
    # stage's cost: the profile counts this process's CPU time, not the wall clock.
    chain = profile_chain(nn.Sequential(nn.Linear(4, 4), Waits(4)), torch.randn(3, 4), repeats=3)
    assert chain.stages[1].forward_seconds < Waits.WAIT / 5
