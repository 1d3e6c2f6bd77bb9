"""The memory promise under ``torch.autocast`` (CPU, bfloat16), with the loss and backward
outside the autocast region (as PyTorch recommends) and inside it (as much user code does).

Autocast is part of the state a plan is made for (a step under it plans anew, profiled under
it), and the executor runs the stages without autocast's cache (a copy lives as long as autograd
saves it). A step that ran the plan profiled without autocast, with autocast's cache keeping a
bfloat16 copy of every weight each stage run casts until the region ends, would hold 1.38 MB
(3 ×) above an MLP's tightest plan in the kept-gradient loop with the backward inside the
region, 429 KB with it outside."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.core.simulator import simulate
from edgetrain.errors import InvalidInput
from edgetrain.planners.optimal import minimum_memory, store_all
from edgetrain.planners.search import least_memory_of
from edgetrain.runtime.checkpointed import Checkpointed
from tests.runtime.test_attention_memory import LOSS_BYTES, Block, Net

BF16 = torch.bfloat16


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = [m for _ in range(5) for m in (nn.Linear(128, 128), nn.GELU())]
    return nn.Sequential(*layers, nn.Linear(128, 10)), torch.randn(32, 128)


def attention() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Net(Block), torch.randn(4, 16, 32)


def step(net: nn.Module, x: torch.Tensor, inside: bool) -> torch.Tensor:
    """One step under autocast; the loss and backward inside the region or after it."""
    with torch.autocast("cpu", dtype=BF16):
        out = net(x)
        if inside:
            out.float().square().sum().backward()
    if not inside:
        out.float().square().sum().backward()
    return out.detach()


def step_peak(net: nn.Module, params: list[nn.Parameter], x, kept: bool, inside: bool) -> int:
    for p in params:
        p.grad = torch.zeros_like(p) if kept else None
    counter = StorageCounter()
    with counter:
        step(net, x, inside)
    return counter.peak_bytes


@pytest.mark.parametrize("make", [mlp, attention])
@pytest.mark.parametrize("kept", [False, True])
def test_plans_made_under_autocast_hold_their_budget_with_the_backward_in_or_out(make, kept):
    model, x = make()
    with torch.autocast("cpu", dtype=BF16):
        chain = Checkpointed(copy.deepcopy(model), x).chain
    least = least_memory_of(chain, grads_exist=kept)  # the smallest edgetrain.plan takes
    everything = simulate(chain, store_all(chain), grads_exist=kept).heap_peak_bytes
    for budget in (least, (least + everything) / 2):
        ours = copy.deepcopy(model)
        schedule = edgetrain.plan(chain, "optimal", memory=budget, grads_exist=kept)
        with torch.autocast("cpu", dtype=BF16):
            net = Checkpointed(ours, x, chain=chain, schedule=schedule)
        for inside in (False, True):
            measured = step_peak(net, list(ours.parameters()), x, kept, inside)
            predicted = net.cost.peak_bytes  # for the loop of the step just run
            assert predicted <= budget + 1
            assert 0.9 * predicted <= measured <= predicted + LOSS_BYTES, (budget, inside)


@pytest.mark.parametrize("inside", [False, True])
def test_a_plan_made_without_autocast_is_made_again_under_it_and_kept_per_state(inside):
    model, x = mlp()
    plain = copy.deepcopy(model)
    net = Checkpointed(model, x, max_recompute=1.5)
    fp32_chain = net.chain
    assert torch.equal(step(net, x, inside), step(plain, x, inside))
    assert net.chain is not fp32_chain  # profiled again, under autocast
    assert net.chain.fingerprint() != fp32_chain.fingerprint()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    # Back without autocast: the first plan again, not the autocast one.
    net(x).sum().backward()
    assert net.chain is fp32_chain
    measured = step_peak(net, list(model.parameters()), x, False, inside)
    assert measured <= net.cost.peak_bytes + LOSS_BYTES


def test_a_change_of_autocast_state_is_named_when_plans_are_refused():
    model, x = mlp()
    net = Checkpointed(model, x, max_recompute=1.5, on_new_shape="error")
    refused = pytest.raises(InvalidInput, match=r"another torch\.autocast state")
    with refused, torch.autocast("cpu", dtype=BF16):
        net(x)


def test_a_chain_measured_in_another_autocast_state_is_refused_with_the_fix_named():
    """A chain from shapes (meta tensors, which autocast does not cast) or profiled without
    autocast, given to a Checkpointed built under it, plans fp32 sizes for a bf16 step (the MLP's
    least plan would measure 536,260 B against its 354,344 B prediction), so it is refused."""
    model, x = mlp()
    refused = pytest.raises(InvalidInput, match=r"chain= was measured without torch\.autocast")
    for chain in (edgetrain.analytic_chain(model, x), Checkpointed(copy.deepcopy(model), x).chain):
        schedule = edgetrain.plan(chain, "optimal", memory=minimum_memory(chain))
        with refused, torch.autocast("cpu", dtype=BF16):
            Checkpointed(copy.deepcopy(model), x, chain=chain, schedule=schedule)
        with refused, torch.autocast("cpu", dtype=BF16):
            Checkpointed(copy.deepcopy(model), x, chain=chain, max_recompute=1.5)
        # Built outside the region with it, a step under autocast plans for autocast.
        ours = copy.deepcopy(model)
        net = Checkpointed(ours, x, chain=chain, max_recompute=1.5)
        step(net, x, True)  # plans (profiles) under autocast: not a step to measure
        measured = step_peak(net, list(ours.parameters()), x, False, True)
        assert net.chain.autocast == ("cpu:bfloat16",)
        assert measured <= net.cost.peak_bytes + LOSS_BYTES


def test_a_chain_profiled_under_autocast_says_so_through_json_and_plans_only_under_it():
    model, x = mlp()
    with torch.autocast("cpu", dtype=BF16):
        chain = Checkpointed(copy.deepcopy(model), x).chain
    assert chain.autocast == ("cpu:bfloat16",)
    again = edgetrain.Chain.from_json(chain.to_json())
    assert again.autocast == chain.autocast and again.fingerprint() == chain.fingerprint()
    schedule = edgetrain.plan(again, "optimal", memory=minimum_memory(again))
    with torch.autocast("cpu", dtype=BF16):
        Checkpointed(copy.deepcopy(model), x, chain=again, schedule=schedule)
    with pytest.raises(InvalidInput, match=r"measured under torch\.autocast\(cpu:bfloat16\)"):
        Checkpointed(copy.deepcopy(model), x, chain=again, schedule=schedule)
