"""The executor's cost per stage is in the predicted time: a plan under ``max_recompute=rho``
predicts at most ``rho`` times plain autograd's time with it, and recomputes less where the
stage count does not pay. (Measured times are in ``benchmarks/executor_overhead.py --rho``.)"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from edgetrain.cache import measured_text
from edgetrain.core.chain import Chain
from edgetrain.core.graph_merge import graph_runs
from edgetrain.core.schedule import Op
from edgetrain.planners.optimal import store_all
from edgetrain.planners.sequential import sequential
from edgetrain.runtime.checkpointed import (
    Checkpointed,
    measure_rebuild_seconds,
    measure_stage_seconds,
)
from edgetrain.runtime.stage_cost import (
    AsRun,
    ExecutorSeconds,
    _machine,
    _read,
    as_run,
    plans_within_time,
    time_factor,
    with_stage_cost,
)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(8 * 16 * 16, 4))


X = torch.randn(4, 8, 16, 16)


def _net(
    monkeypatch: pytest.MonkeyPatch, seconds: float, rho: float, chain: Chain | None = None
) -> Checkpointed:
    """Planned with a stage cost of ``seconds``; on ``chain`` when given, so that two plans
    compared share one profile's times (two profiles of one model differ on a busy machine)."""
    monkeypatch.setenv("EDGETRAIN_STAGE_SECONDS", repr(seconds))
    return Checkpointed(_model(), X, max_recompute=rho, chain=chain)


def _recomputations(net: Checkpointed) -> int:
    return sum(1 for kind, _ in net.schedule if kind.is_forward) - net.chain.length


@pytest.mark.parametrize("rho", [1.2, 1.5, 2.0])
def test_the_predicted_time_with_the_stage_cost_keeps_to_rho(monkeypatch, rho):
    free = _net(monkeypatch, 0.0, rho)
    plain = free.chain.forward_seconds + free.chain.backward_seconds
    per_stage = plain / free.chain.length / 4  # a stage costs the executor a quarter of its mean
    net = _net(monkeypatch, per_stage, rho, free.chain)
    assert net.predicted_recompute_factor <= rho + 1e-9
    assert net.predicted_seconds <= rho * plain + 1e-12
    assert _recomputations(net) <= _recomputations(free)
    ops = net.schedule.count(*(op for op in Op if op.is_forward), Op.BACKWARD)
    if net.runs_as.endswith("stages"):
        assert net.predicted_seconds > net.cost.seconds or ops == 0


def test_a_stage_cost_that_eats_the_slack_runs_the_plan_as_one_graph(monkeypatch):
    free = _net(monkeypatch, 0.0, 1.5)
    assert _recomputations(free) > 0
    plain = free.chain.forward_seconds + free.chain.backward_seconds
    net = _net(monkeypatch, plain, 1.5, free.chain)  # each stage operation costs a whole plain step
    assert net.runs_as in ("one graph", "the module itself")
    assert net.predicted_recompute_factor <= 1.5 + 1e-9
    # It still saves memory: the recomputation runs inside the one graph, at no stage cost.
    assert _recomputations(net) > 0
    assert net.cost.peak_bytes < net.plain_cost.peak_bytes


def test_stage_and_rebuild_costs_that_eat_the_slack_store_everything(monkeypatch):
    free = _net(monkeypatch, 0.0, 1.5)
    plain = free.chain.forward_seconds + free.chain.backward_seconds
    monkeypatch.setenv("EDGETRAIN_REBUILD_SECONDS", repr(plain))  # a unit rebuilt: a whole step
    net = _net(monkeypatch, plain, 1.5, free.chain)
    assert _recomputations(net) == 0
    assert net.predicted_recompute_factor <= 1.5


@pytest.mark.parametrize("rho", [1.2, 1.5, 2.0])
def test_the_rebuild_costs_are_in_the_predicted_time(monkeypatch, rho):
    free = _net(monkeypatch, 0.0, rho)
    plain = free.chain.forward_seconds + free.chain.backward_seconds
    mean = plain / free.chain.length
    monkeypatch.setenv("EDGETRAIN_REBUILD_SECONDS", repr(mean))  # a unit: a mean stage's step
    monkeypatch.setenv("EDGETRAIN_REBUILT_STAGE_SECONDS", repr(mean / 2))
    net = _net(monkeypatch, mean / 4, rho, free.chain)
    assert net.predicted_recompute_factor <= rho + 1e-9
    run = net._as_run
    executor = mean / 4 * run.operations + mean * run.rebuilds + mean / 2 * run.rebuilt_stages
    assert net.predicted_seconds == pytest.approx(net.cost.seconds + executor)
    assert net.cost.peak_bytes <= net.plain_cost.peak_bytes


def test_as_run_counts_the_runs_as_they_run():
    chain = Checkpointed(_model(), X).chain
    assert as_run(store_all(chain)) == AsRun(0, 0, 0)  # one graph, nothing rebuilt
    segments = sequential(chain, 4)
    runs = graph_runs(segments)
    counted = as_run(segments)
    assert counted.rebuilds == sum(len(run.rebuilds) for run in runs) > 0
    whole = len(runs) == 1 and runs[0].last == chain.length - 1
    assert whole  # checkpoint_sequential's plan: one graph, its segments under checkpoint
    assert counted.rebuilt_stages == sum(
        j - k + 1 for run in runs for k, j in run.checkpointed
    ) + sum(len(run.recomputed) for run in runs)
    assert counted.operations == 0 if whole else counted.operations > 0
    stage_by_stage = segments.count(*(op for op in Op if op.is_forward), Op.BACKWARD)
    assert counted.operations < stage_by_stage
    unmerged = as_run(segments, [])  # nothing merged: every forward after a stage's first reruns
    forwards = segments.count(*(op for op in Op if op.is_forward))
    assert unmerged == AsRun(stage_by_stage, 0, forwards - chain.length)
    assert ExecutorSeconds(1.0, 10.0, 100.0).of(AsRun(1, 2, 3)) == 321.0


def test_time_factor_and_the_costly_chain_agree():
    chain = Checkpointed(_model(), X).chain
    costly = with_stage_cost(chain, 0.5)
    plain = chain.forward_seconds + chain.backward_seconds
    assert costly.forward_seconds + costly.backward_seconds == pytest.approx(
        plain + 2 * chain.length * 0.5
    )
    factor = time_factor(chain, 1.5, 0.5)
    assert factor * (costly.forward_seconds + costly.backward_seconds) == pytest.approx(1.5 * plain)


def test_the_calibration_measures_and_the_cache_is_checked(tmp_path):
    seconds = measure_stage_seconds(stages=4, rounds=3)
    assert 0.0 <= seconds < 0.1
    path = tmp_path / "stage_seconds.json"
    path.write_text(measured_text(_machine(), {"stage_seconds": 7e-5}))
    assert _read(path) == 7e-5
    path.write_text(measured_text("another", {"stage_seconds": 7e-5}))
    assert _read(path) is None
    damaged = json.loads(measured_text(_machine(), {"stage_seconds": 7e-5}))
    damaged["values"]["stage_seconds"] = 8e-5  # the checksum no longer matches
    path.write_text(json.dumps(damaged))
    assert _read(path) is None
    path.write_text("{not json")
    assert _read(path) is None
    path.write_text(measured_text(_machine(), {"stage_seconds": 7e-5, "rebuild_seconds": 2e-4}))
    assert (_read(path), _read(path, "rebuild_seconds")) == (7e-5, 2e-4)
    unit, stage = measure_rebuild_seconds(blocks=6, rounds=3)
    assert 0.0 <= unit < 0.1 and 0.0 <= stage < 0.1


def test_plans_for_a_recompute_factor_carry_no_memory_budget():
    """A plan read off the frontier for ``max_recompute`` keeps no table budget: the executor
    would otherwise bound its merged runs' heap by it and run them stage by stage."""
    chain = Checkpointed(_model(), X).chain
    plain = chain.forward_seconds + chain.backward_seconds
    # Stage by stage costs a mean stage per operation; one graph costs nothing more.
    seconds = ExecutorSeconds(plain / chain.length, 0.0, 0.0)
    plans = plans_within_time(chain, "optimal", 2.0, seconds, False)
    assert len(plans) >= 2  # the frontier's candidates, then the stage-by-stage plan
    for schedule in plans[:-1]:
        assert "budget_bytes" not in schedule.params
        assert schedule.params["recompute_target"] == 2.0
        assert schedule.params["made_for"]["chain"] == chain.fingerprint()
