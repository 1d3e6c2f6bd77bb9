"""Mistakes that need no profile are refused before it: a memory budget below the weights (from
the parameter count), a plan made for another model (naming both), a flag's format."""

from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import edgetrain.cli.demo
import edgetrain.cli.plan
import edgetrain.runtime.checkpointed
import edgetrain.runtime.prepared
from edgetrain import plan
from edgetrain.cli.main import cli
from edgetrain.errors import InfeasibleBudget, InvalidSchedule
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.models import model_chain
from edgetrain.runtime.checkpointed import Checkpointed
from tests.cli.test_errors import refused


def _no_profile(*_args, **_kwargs):
    raise AssertionError("profiled before refusing")


def _mlp(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 4)).double()


def test_a_budget_below_the_weights_is_refused_before_the_profile(monkeypatch):
    monkeypatch.setattr(edgetrain.runtime.prepared, "profile_chain", _no_profile)
    model, x = _mlp(256), torch.randn(8, 32, dtype=torch.float64)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(InfeasibleBudget, match="the step starts with") as caught:
        Checkpointed(model, x, memory_budget=weights)
    # Refused from the chain's shapes, before any profile, with a smallest budget that plans.
    smallest = caught.value.smallest
    assert smallest is not None and smallest > weights + x.numel() * x.element_size()
    monkeypatch.undo()
    net = Checkpointed(model, x, memory_budget=smallest)
    assert net.predicted_peak_bytes <= smallest


def test_a_plan_for_another_model_is_refused_before_the_profile_naming_both(monkeypatch):
    x = torch.randn(8, 32, dtype=torch.float64)
    chain = analytic_chain(_mlp(256), x)
    schedule = plan(replace(chain, name="wide-mlp"), "optimal")
    monkeypatch.setattr(edgetrain.runtime.prepared, "profile_chain", _no_profile)
    with pytest.raises(InvalidSchedule, match=r"made for wide-mlp .* not for Sequential"):
        Checkpointed(_mlp(128), x, schedule=schedule)
    with pytest.raises(InvalidSchedule, match=r"an input of 2048 bytes\), not for Sequential"):
        Checkpointed(_mlp(256), x[:4].clone(), schedule=schedule)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["poet", "--memory", "lots"], "cannot read size 'lots'"),
        (["poet", "--memory", "half%"], "cannot read --memory 'half%'; write e.g. 50% or 2MB"),
        (["poet", "--memory", "-5%"], "must be positive"),
    ],
)
def test_poet_reads_its_flags_before_any_work(args, message):
    assert message in refused(args)


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--model", "resnet101", "--memory", "100MB"],
        ["demo", "--memory", "10MB"],
        ["train", "--model", "resnet18", "--memory", "10MB"],
    ],
)
def test_a_budget_below_the_weights_is_refused_before_any_chain_or_profile(args, monkeypatch):
    for module in (edgetrain.cli.plan, edgetrain.cli.demo):
        monkeypatch.setattr(module, "model_chain", _no_profile)
    monkeypatch.setattr(edgetrain.runtime.prepared, "profile_chain", _no_profile)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and "does not hold the weights" in lines[0], result.output


def test_train_refuses_a_plan_for_another_model_before_any_work(tmp_path):
    path = tmp_path / "plan.json"
    plan(model_chain("resnet18", 2, 64, timing=False), "optimal").save(path)
    args = ["train", "--model", "resnet34", "--batch", "2", "--image", "64", "--plan"]
    line = refused([*args, str(path)])
    assert "made for resnet18 (" in line and "not for resnet34 (" in line
