"""``explain``: what a plan holds at its predicted peak, by category, from the simulator's replay;
measured beside predicted after a step; ``edgetrain plan --explain``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from edgetrain.core.chain import uniform_chain
from edgetrain.core.explain import STEP, UNSPLIT, explain_plan, step_parts
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import memory_trace, replay_state, simulate
from edgetrain.errors import InfeasibleBudget
from edgetrain.planners.optimal import store_all
from edgetrain.planners.search import plan
from edgetrain.runtime.checkpointed import Checkpointed
from tests.conftest import chains

ROOT = Path(__file__).resolve().parents[2]


@settings(max_examples=60, deadline=None)
@given(
    chains(max_length=7),
    st.sampled_from(["optimal", "revolve", "sequential"]),
    st.booleans(),
    st.floats(0.2, 1.0),
)
def test_the_parts_add_up_to_what_the_replay_holds_at_every_operation(
    chain, strategy, grads_exist, fraction
):
    peak = simulate(chain, store_all(chain), grads_exist=grads_exist).peak_bytes
    try:
        schedule = plan(chain, strategy, memory=int(fraction * peak), grads_exist=grads_exist)
    except InfeasibleBudget:
        return
    trace = memory_trace(chain, schedule, grads_exist=grads_exist)
    first_backward = schedule.forward_phase_end
    for i in range(len(schedule)):
        state = replay_state(chain, schedule, i, grads_exist=grads_exist)
        total = sum(p.bytes for p in step_parts(chain, state, grads_exist=grads_exist))
        assert total == state.held_bytes
        if i != first_backward:  # the loss's gradient enters with the first backward
            assert total == trace[i][0]
    explained = explain_plan(chain, schedule, grads_exist=grads_exist, fixed={"weights": 7})
    cost = simulate(chain, schedule, grads_exist=grads_exist)
    assert sum(explained.by_category().values()) == explained.peak_bytes == cost.peak_bytes + 7
    assert explained.position == cost.peak_op


def test_checkpoints_and_graphs_are_named_by_stage():
    # Four equal stages: a[1] kept as a checkpoint, the graphs of 2 and 3 built, their backward,
    # then stages 0 and 1 again from the input.
    chain = uniform_chain(4, activation_bytes=10)
    ops = [
        (Op.FORWARD_CHECKPOINT, 0), (Op.FORWARD_CHECKPOINT, 1), (Op.FORWARD_ALL, 2),
        (Op.FORWARD_ALL, 3), (Op.BACKWARD, 3), (Op.BACKWARD, 2),
        (Op.DISCARD, 1), (Op.FORWARD_ALL, 0), (Op.FORWARD_ALL, 1), (Op.BACKWARD, 1),
        (Op.BACKWARD, 0),
    ]  # fmt: skip
    schedule = Schedule.from_ops(4, ops)
    explained = explain_plan(chain, schedule)
    staged = {(p.category, p.stage): p.bytes for p in explained.parts}
    held = replay_state(chain, schedule, explained.position, grads_exist=False)
    assert explained.peak_bytes == simulate(chain, schedule).peak_bytes
    checkpoints = {k for k in range(1, 4) if held.plain[k]}
    graphs = {k for k in range(4) if held.graph[k]}
    assert {s for c, s in staged if c == "checkpoint"} == checkpoints
    assert {s for c, s in staged if c == "kept graph"} <= graphs
    assert "running" in explained.by_category()
    assert str(explained).startswith(f"peak {explained.peak_bytes} B at ")


def _model() -> nn.Sequential:
    torch.manual_seed(0)

    def block(c: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.Tanh())

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        *[block(8) for _ in range(6)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    ).double()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_measured_step_matches_the_prediction_category_by_category(set_to_none):
    model = _model()
    x = torch.randn(4, 3, 24, 24, dtype=torch.float64)
    y = torch.randint(0, 10, (4,))
    # The smallest budget: half of plain autograd's step leaves no room for the float64
    # convolutions' im2col scratch (1 MiB a stage, seven times a stage's output).
    net = Checkpointed(model, x, memory_budget="min")
    assert net.runs_as != "the module itself"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):  # the loop is the user's from the second step on; measure the third
        optimizer.zero_grad(set_to_none=set_to_none)
        with net.measuring():
            out = net(x)  # held by the caller through the backward, as the plan counts
            nn.functional.cross_entropy(out, y).backward()
            del out
        optimizer.step()
    explained = net.explain()
    assert explained.grads_exist is not set_to_none
    assert explained.peak_bytes == net.predicted_peak_bytes
    predicted = explained.by_category()
    assert predicted.get("checkpoint", 0) + predicted.get("kept graph", 0) > 0
    assert UNSPLIT in explained.measured or net.runs_as.endswith("stages")
    # The caller's loss and its gradient, float64 scalars alive through the backward: not
    # planned (the caller's), in the probe's residual ("kept graph").
    loss_bytes = 16
    for category, measured in explained.measured.items():
        if category == UNSPLIT:  # the plan ran as one graph: measured whole
            continue
        extra = loss_bytes if category == "kept graph" else 0
        assert 0 <= measured - predicted.get(category, 0) <= extra, category
    assert explained.measured_peak_bytes is not None
    # never above the prediction (but the caller's loss), within the contract's 2 % below it
    below = explained.peak_bytes - explained.measured_peak_bytes
    assert -loss_bytes <= below <= 0.02 * explained.peak_bytes
    assert "measured" in str(explained)


def test_explain_without_a_measured_step_has_no_measured_column():
    model = _model()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    net = Checkpointed(model, x, max_recompute=1.5)
    explained = net.explain()
    assert not explained.measured and explained.measured_peak_bytes is None
    assert set(explained.by_category()) - {"weights", "buffers", "input"} <= set(STEP)
    assert explained.peak_bytes == net.predicted_peak_bytes
    assert "measured" not in str(explained).splitlines()[1]


def test_plan_explain_prints_the_peak_by_category_and_as_json():
    args = ["plan", "--model", "resnet18", "--batch", "2", "--image", "64", "--memory", "160MB"]
    run = [sys.executable, "-c", "from edgetrain.cli.main import main; main()", *args]
    text = subprocess.run([*run, "--explain"], cwd=ROOT, capture_output=True, text=True)
    assert text.returncode == 0, text.stderr[-2000:]
    assert "kept graph" in text.stdout and "plain autograd:" in text.stdout
    data = subprocess.run([*run, "--explain", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert data.returncode == 0, data.stderr[-2000:]
    report = json.loads(data.stdout)
    explained = report["explain"]
    assert explained["peak_bytes"] == report["peak_bytes"]
    assert sum(explained["by_category"].values()) == report["peak_bytes"]


def test_a_step_run_as_the_module_itself_is_measured_whole():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    x = torch.randn(8, 16)
    net = Checkpointed(model, x)
    assert net.runs_as == "the module itself"
    with net.measuring():
        out = net(x)
        out.backward(torch.ones_like(out))  # an output-sized gradient, as the profile's step
        del out
    explained = net.explain()
    assert UNSPLIT in explained.measured
    assert explained.measured_peak_bytes == explained.peak_bytes
    assert sum(explained.by_category().values()) == explained.peak_bytes
    assert "measured whole" in str(explained)
