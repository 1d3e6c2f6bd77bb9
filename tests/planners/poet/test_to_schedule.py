"""MILP plans that run: the matrices become a Schedule the one simulator and executor accept,
with the MILP's time and energy, within its budget, and autograd's gradients."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from edgetrain.core.chain import Chain, Stage
from edgetrain.core.schedule import Op
from edgetrain.core.simulator import simulate
from edgetrain.devices.energy import EnergyProfile
from edgetrain.errors import InfeasibleBudget, InvalidInput, InvalidSchedule
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.planners import FRONTIER_STRATEGIES, STRATEGIES, plan
from edgetrain.planners.optimal import store_all
from edgetrain.planners.poet import check, milp
from edgetrain.planners.poet import graph as G
from edgetrain.planners.poet.to_schedule import (
    TOLERANCE,
    device_cost,
    plan_poet,
    schedule_from_plan,
)
from edgetrain.planners.search import frontier
from edgetrain.runtime.checkpointed import Checkpointed
from tests.conftest import UNIT, loss_and_peak, output_saving_chain

# Paging is cheap next to recomputing (1 GB/s at 0.1 W; 1 GFLOP per joule): plans page.
CHEAP_PAGING = EnergyProfile(
    name="cheap-paging",
    title="test device: paging much cheaper than recomputation",
    flops_per_second=1e9,
    flops_per_joule=1e9,
    pagein_latency_seconds=0.0,
    pagein_bytes_per_second=1e9,
    pageout_latency_seconds=0.0,
    pageout_bytes_per_second=1e9,
    memory_watts=0.1,
    compute_watts=1.0,
)


def _chain(forward: list[float], size: int = 8, saves_input: bool = False) -> Chain:
    stages = []
    for k, seconds in enumerate(forward):
        stages.append(
            Stage(
                name=f"s{k}",
                output_bytes=size,
                saved_bytes=4 if saves_input else 0,
                saves_input=saves_input,
                saves_output=not saves_input,
                forward_peak_bytes=size,
                forward_grad_peak_bytes=size + (4 if saves_input else 0),
                backward_peak_bytes=size if k else 0,
                weight_bytes=0,
                gradient_bytes=0,
                forward_seconds=seconds,
                backward_seconds=seconds,
            )
        )
    return Chain(tuple(stages), input_bytes=8)


def _assert_exact(chain: Chain, device: EnergyProfile, budget: float) -> tuple[int, int]:
    """Solve, convert, and check the schedule against the MILP; returns (pages out, peak)."""
    graph = G.from_chain(chain, device)
    result = milp.solve(graph, ram_bytes=budget, runnable=True)
    assert result.status == "optimal" and result.plan is not None
    schedule = schedule_from_plan(chain, graph, result.plan)
    cost = simulate(chain, schedule)
    on_device = device_cost(chain, schedule, device)
    assert result.evaluation is not None
    assert on_device.energy_joules == pytest.approx(result.energy_joules, rel=TOLERANCE)
    assert on_device.seconds == pytest.approx(result.evaluation.runtime_seconds, rel=TOLERANCE)
    # One operation per MILP variable set: computations, page-outs and page-ins.
    forwards = schedule.count(Op.FORWARD_NOSAVE, Op.FORWARD_CHECKPOINT, Op.FORWARD_ALL)
    assert forwards == int(result.plan["R"][:, : chain.length].sum())
    assert cost.pages_out == result.evaluation.paged_out
    assert cost.pages_in == result.evaluation.paged_in
    # The schedule holds a subset of what the MILP counts: within its peak and the budget.
    assert cost.peak_bytes <= result.evaluation.peak_ram_bytes <= budget
    return cost.pages_out, cost.peak_bytes


@pytest.mark.parametrize("first", [0, 1])
def test_milp_plans_with_paging_simulate_to_the_milps_energy_and_time(first: int) -> None:
    forward = [1.0] * 9
    forward[first] = 20.0  # an expensive stage: its output is worth paging rather than redoing
    chain = _chain(forward)
    everything = simulate(chain, store_all(chain)).peak_bytes
    pages = [_assert_exact(chain, CHEAP_PAGING, everything * f)[0] for f in (0.7, 0.6, 0.5)]
    assert max(pages) >= 1


@pytest.mark.parametrize("seed", range(3))
def test_milp_plans_on_random_chains_run_exactly_or_are_refused(seed: int) -> None:
    rng = random.Random(seed)
    chain = _chain([float(rng.randint(1, 9)) for _ in range(7)], saves_input=seed == 2)
    graph = G.from_chain(chain, CHEAP_PAGING)
    everything = check.evaluate(graph, check.store_all(graph), "edgetrain").peak_ram_bytes
    for fraction in (0.8, 0.65, 0.5):
        result = milp.solve(graph, ram_bytes=everything * fraction, runnable=True)
        if result.plan is None:
            continue
        _assert_exact(chain, CHEAP_PAGING, everything * fraction)


def test_unrestricted_paging_plans_are_refused_not_run_differently() -> None:
    """Without ``runnable`` the MILP pages a forward node back in for its backward: the graph
    autograd built would have to be paged, which no executor does. Refused, one line."""
    chain = _chain([1.0, 20.0] + [1.0] * 7)
    graph = G.from_chain(chain, CHEAP_PAGING)
    everything = simulate(chain, store_all(chain)).peak_bytes
    result = milp.solve(graph, ram_bytes=everything * 0.6, mode="paging")
    assert result.plan is not None and result.evaluation is not None
    assert result.evaluation.paged_out >= 1
    with pytest.raises(InvalidSchedule, match="cannot run as a chain schedule"):
        schedule_from_plan(chain, graph, result.plan)


@pytest.mark.parametrize("seed", range(4))
def test_remat_milp_schedules_simulate_to_the_milps_time_and_never_above_the_dps(
    seed: int,
) -> None:
    """The chains of test_milp's DP comparison: the MILP's plan without paging, as a schedule,
    simulates to the MILP's time, which equals the optimal chain DP's or beats it (the DP keeps
    each checkpoint until its sub-chain is done), within the same budget."""
    rng = random.Random(seed)
    chain = output_saving_chain(rng, 5, saves_input=False)
    graph = G.from_chain(chain, UNIT, chain_flops_per_second=1.0)
    peak = simulate(chain, store_all(chain)).peak_bytes
    equal = runs = 0
    for budget in range(4, peak + 5, 4):
        try:
            dp = simulate(chain, plan(chain, "optimal", memory=budget, slots=budget)).seconds
        except InfeasibleBudget:
            continue
        result = milp.solve(graph, ram_bytes=budget, mode="remat", runnable=True)
        assert result.plan is not None and result.energy_joules is not None
        schedule = schedule_from_plan(chain, graph, result.plan)
        cost = simulate(chain, schedule)
        assert cost.peak_bytes <= budget
        assert cost.seconds == pytest.approx(result.energy_joules, rel=TOLERANCE)
        assert cost.seconds <= dp * (1 + TOLERANCE)
        equal += cost.seconds == pytest.approx(dp, rel=TOLERANCE)
        runs += 1
    assert runs >= 3 and 2 * equal >= runs


def _user_model() -> nn.Sequential:
    torch.manual_seed(3)
    acts = [nn.Tanh, nn.GELU, nn.SiLU]
    layers: list[nn.Module] = []
    for i in range(6):
        layers += [nn.Linear(32, 32), acts[i % 3]()]
    return nn.Sequential(*layers, nn.Linear(32, 4)).double()


def test_a_poet_plan_runs_with_autograds_gradients_and_its_predicted_peak(tmp_path: Path) -> None:
    model = _user_model()
    reference = copy.deepcopy(model)
    x = torch.randn(256, 32, dtype=torch.float64)
    chain = analytic_chain(model, x)
    everything = simulate(chain, store_all(chain)).peak_bytes
    # a generous limit: on a loaded machine 10 s of wall time can end the search at an incumbent
    # that does not page yet
    poet = plan_poet(chain, CHEAP_PAGING, memory=0.6 * everything, time_limit=60)
    assert poet.cost.pages_out >= 1 and poet.cost.peak_bytes <= 0.6 * everything
    assert poet.device_cost.energy_joules == pytest.approx(poet.result.energy_joules, rel=TOLERANCE)
    net = Checkpointed(model, x, chain=chain, schedule=poet.schedule, page_dir=tmp_path)
    loss, measured = loss_and_peak(net, x)
    ref_loss, _ = loss_and_peak(reference, x)
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    # The real peak is within the prediction and less than one activation below it: the
    # simulator's estimate of these layers' backward is that conservative with or without
    # paging (the chain DP's plan at the same budget: 427 824 B measured, 436 000 predicted).
    largest = max(stage.output_bytes for stage in chain.stages)
    assert poet.cost.peak_bytes - largest < measured <= poet.cost.peak_bytes


def test_plan_poet_says_when_nothing_fits() -> None:
    chain = _chain([1.0] * 4)
    with pytest.raises(InfeasibleBudget, match="POET finds no plan"):
        plan_poet(chain, CHEAP_PAGING, memory=8)


def test_plan_with_strategy_poet_is_the_milps_schedule() -> None:
    chain = _chain([1.0, 20.0] + [1.0] * 7)
    everything = simulate(chain, store_all(chain)).peak_bytes
    schedule = plan(chain, "poet", memory=0.6 * everything, device=CHEAP_PAGING)
    direct = plan_poet(chain, CHEAP_PAGING, memory=0.6 * everything)
    assert schedule.strategy == "poet" and schedule.params["status"] == "optimal"
    assert schedule.params["energy_J"] == pytest.approx(direct.result.energy_joules, rel=1e-9)
    assert device_cost(chain, schedule, CHEAP_PAGING).energy_joules == pytest.approx(
        direct.device_cost.energy_joules, rel=TOLERANCE
    )
    assert simulate(chain, schedule).pages_out >= 1
    with pytest.raises(InvalidInput, match="needs a device"):
        plan(chain, "poet", memory=0.6 * everything)


def test_poet_is_one_of_the_strategies_and_has_no_frontier() -> None:
    """``plan`` takes every name in ``STRATEGIES``, POET's among them; the memory/time frontier
    is the budget search's, which POET's MILP (one budget at a time) has not: refused in one
    line naming the strategies that have one."""
    assert "poet" in STRATEGIES and set(FRONTIER_STRATEGIES) == set(STRATEGIES) - {"poet"}
    chain = _chain([1.0, 20.0] + [1.0] * 7)
    everything = simulate(chain, store_all(chain)).peak_bytes
    for strategy in STRATEGIES:
        device = CHEAP_PAGING if strategy == "poet" else None
        schedule = plan(chain, strategy, memory=0.6 * everything, device=device)
        assert schedule.strategy == strategy
        assert simulate(chain, schedule).peak_bytes <= 0.6 * everything
    with pytest.raises(InvalidInput, match="no frontier; choose one of optimal, blocks"):
        frontier(chain, "poet")


def test_stages_that_save_their_input_retain_it_only_in_the_graph_backward_reads(
    tmp_path: Path,
) -> None:
    """Linear and GELU keep their input for backward: only the graph a backward reads retains
    it (a checkpoint recomputed without grad keeps nothing), as the executor holds it. A POET
    plan at 70 % of keep-everything (proven optimal) runs within its prediction with autograd's
    gradients."""
    torch.manual_seed(5)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(32, 32), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(32, 4)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(128, 32, dtype=torch.float64)
    chain = analytic_chain(model, x)
    everything = simulate(chain, store_all(chain)).peak_bytes
    poet = plan_poet(chain, CHEAP_PAGING, memory=0.7 * everything, time_limit=60)
    assert poet.result.status == "optimal" and poet.cost.pages_out >= 1
    assert poet.cost.peak_bytes <= 0.7 * everything
    net = Checkpointed(model, x, chain=chain, schedule=poet.schedule, page_dir=tmp_path)
    loss, measured = loss_and_peak(net, x)
    ref_loss, _ = loss_and_peak(reference, x)
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    assert measured <= poet.cost.peak_bytes
