"""Block options: rotor's DP over blocks, each block run one of several
ways. Every plan is expanded to the fine chain and replayed by the one simulator: exactly the
predicted time, a peak within the budget. With one stage per block it is the flat DP; without
shared storages it is never faster than the flat DP; its options are a Pareto frontier; and a
captured residual model trains under it exactly, holding what was predicted."""

import contextlib
import copy
import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.core.chain import Chain, Stage
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.frontend.cuts import as_stages
from edgetrain.frontend.fx_capture import ALL_CUTS_UP_TO, all_cuts, capture
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.models import build, sample_input
from edgetrain.planners import blocks as blocks_module
from edgetrain.planners.blocks import (
    CARRIED_SHARE,
    block_options,
    block_plan,
    blocks_of,
    minimum_block_memory,
    plan_blocks,
)
from edgetrain.planners.optimal import OptimalTable, TableMaker, fastest, store_all
from edgetrain.planners.search import FLAT_UP_TO, frontier
from edgetrain.runtime.checkpointed import Checkpointed
from tests.conftest import random_chain
from tests.helpers import same_state
from tests.runtime.test_any_model import F64, ResidualMLP, measured_peak, train_step


def residual_chain(rng: random.Random, blocks: int, *, carried: bool = True) -> Chain:
    """Random residual blocks: inside a block every cut carries two tensors, the block's input
    (the skip; the same storage when ``carried``) and the trunk; a block ends in one tensor."""
    stages = []
    width = first = rng.randint(1, 6)
    for b in range(blocks):
        inner = rng.randint(1, 3)
        for i in range(inner + 1):
            trunk, saved, weights = rng.randint(1, 6), rng.randint(0, 3), rng.randint(0, 3)
            if i == inner:
                out, leaves, carry, saved_inputs = rng.randint(1, 6), (), (), None
            else:
                out, leaves = width + trunk, (width, trunk)
                carry = ((0, 0),) if carried else ()
                saved_inputs = (1,) if carried and i > 0 and rng.random() < 0.4 else None
            stages.append(
                Stage(
                    name=f"b{b}s{i}",
                    output_bytes=out,
                    saved_bytes=saved,
                    saves_input=rng.random() < 0.7,
                    saves_output=rng.random() < 0.4,
                    forward_peak_bytes=out + rng.randint(0, 2),
                    forward_grad_peak_bytes=out + saved + rng.randint(0, 2),
                    backward_peak_bytes=rng.randint(1, 8),
                    weight_bytes=weights,
                    gradient_bytes=weights if rng.random() < 0.5 else 0,
                    forward_seconds=float(rng.randint(1, 4)),
                    backward_seconds=float(rng.randint(1, 5)),
                    leaf_bytes=leaves,
                    carried=carry,
                    saved_inputs=saved_inputs,
                    input_gradient_bytes=rng.choice([None, max(1, width // 2)]) if i == 0 else None,
                )
            )
        width = stages[-1].output_bytes
    return Chain(tuple(stages), input_bytes=first, input_requires_grad=rng.random() < 0.5)


SLOTS = 160  # one-byte slots: no rounding on these chains


def _small_beside(chain: Chain, k: int) -> bool:
    sizes = chain.leaf_sizes(k)
    return (sum(sizes) - max(sizes)) * CARRIED_SHARE <= max(sizes)


def test_blocks_end_where_one_tensor_of_its_own_crosses():
    chain = residual_chain(random.Random(1), 3)
    found = blocks_of(chain)
    assert found[0].start == 0 and found[-1].stop == chain.length
    for block in found:
        end = chain.stages[block.stop - 1]
        assert end.output_leaves == 1 or _small_beside(chain, block.stop)
        assert all(
            chain.stages[k].output_leaves == 2 and not _small_beside(chain, k + 1)
            for k in block[:-1]
        )
    assert blocks_of(chain, [found[1].start]) == (
        range(0, found[1].start),
        range(found[1].start, chain.length),
    )
    with pytest.raises(InvalidInput, match="not cuts where one tensor of its own crosses"):
        blocks_of(chain, [1])


class _MaskedLayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        C = x.shape[-1]
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=2)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(C) + mask
        x = x + self.proj(scores.softmax(dim=-1) @ v)
        return x + self.mlp(self.norm2(x))


class _MaskedEncoder(nn.Module):
    """Every layer takes the same additive mask, made from the input (which tokens count), as
    Hugging Face's encoders take theirs."""

    def __init__(self, width: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MaskedLayer(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x[:, :, 0] < -1.0).to(x.dtype)[:, None, :] * -1e4  # (B, 1, T)
        for layer in self.layers:
            x = layer(x, mask)
        return x


def test_a_mask_every_layer_takes_does_not_merge_the_layers_into_one_block():
    torch.manual_seed(0)
    x = torch.randn(8, 64, 32)
    chain = analytic_chain(_MaskedEncoder(), x)
    found = blocks_of(chain)
    assert len(found) >= 4  # one block per layer at least
    for block in found[:-1]:
        sizes = chain.leaf_sizes(block.stop)
        assert len(sizes) > 1 or chain.stages[block.stop - 1].output_leaves == 1
    points = frontier(chain, "blocks", grads_exist=True).points
    assert points[0].peak_bytes < 0.5 * points[-1].peak_bytes


@pytest.mark.parametrize("grads_exist", [False, True])
def test_every_block_plan_runs_with_the_predicted_time_within_its_budget(grads_exist):
    rng = random.Random(5)
    for _ in range(25):
        chain = residual_chain(rng, rng.randint(1, 3))
        table = block_plan(chain, grads_exist=grads_exist).maker().table(1.0, SLOTS)
        times = table.times()
        assert np.isfinite(times).any()
        for m in np.flatnonzero(np.isfinite(times)):
            schedule = table.schedule(int(m))
            cost = simulate(chain, schedule, grads_exist=grads_exist)  # raises if invalid
            assert cost.seconds == pytest.approx(times[m], abs=1e-9)
            assert cost.peak_bytes <= m


def test_with_one_stage_per_block_it_is_the_flat_dp():
    rng = random.Random(11)
    for _ in range(40):
        chain = random_chain(rng, rng.randint(1, 6))
        plan = block_plan(chain)
        assert [len(b) for b in plan.blocks] == [1] * chain.length
        # Between blocks the recursion is rotor's: the flat DP without the release start.
        flat = OptimalTable(chain, 1.0, SLOTS, release=False).times()
        blocks = plan.maker().table(1.0, SLOTS).times()
        assert np.array_equal(np.isfinite(flat), np.isfinite(blocks))
        assert np.allclose(flat[np.isfinite(flat)], blocks[np.isfinite(blocks)], rtol=0, atol=1e-9)


def test_without_shared_storages_it_is_never_faster_than_the_flat_dp():
    # Its plans are rotor-form plans of the fine chain, and with nothing shared the flat DP's
    # accounting is exact: the flat DP's optimum bounds it at every budget.
    rng = random.Random(3)
    for _ in range(40):
        chain = residual_chain(rng, rng.randint(1, 3), carried=False)
        flat = OptimalTable(chain, 1.0, SLOTS).times()
        blocks = block_plan(chain).maker().table(1.0, SLOTS).times()
        assert np.all(blocks >= flat - 1e-9)


def _ending_in_a_view(chain: Chain) -> Chain:
    """``chain`` followed by a stage whose output is a view of its input (a flatten)."""
    out = chain.stages[-1].output_bytes
    view = dataclasses.replace(
        NOTHING, name="flatten", output_bytes=out, leaf_bytes=(out,), carried=((0, 0),)
    )
    return dataclasses.replace(chain, stages=(*chain.stages, view))


@pytest.mark.parametrize("grads_exist", [False, True])
def test_a_chain_ending_in_a_view_of_its_last_output_still_plans_below_storing_everything(
    grads_exist,
):
    rng = random.Random(5)
    for _ in range(20):
        plain = residual_chain(rng, rng.randint(1, 3))
        chain = _ending_in_a_view(plain)
        options = block_plan(chain, grads_exist=grads_exist).options
        assert all(options), "every block has an option"
        saves = frontier(plain, "blocks", grads_exist=grads_exist, slots=SLOTS)
        ours = frontier(chain, "blocks", grads_exist=grads_exist, slots=SLOTS)
        if saves.smallest_bytes < saves.points[-1].peak_bytes:
            assert ours.smallest_bytes < ours.points[-1].peak_bytes
        for point in ours.points:
            cost = simulate(chain, point.schedule, grads_exist=grads_exist)
            assert cost.heap_peak_bytes == point.peak_bytes


def test_options_are_a_pareto_frontier_of_valid_plans_of_the_block():
    rng = random.Random(8)
    for _ in range(15):
        chain = residual_chain(rng, 3)
        for block in blocks_of(chain):
            options = block_options(chain, block)
            assert options[0].kind == "store all"  # the fastest, first
            assert options[0].seconds == pytest.approx(
                sum(
                    chain.stages[k].forward_seconds + chain.stages[k].backward_seconds
                    for k in block
                )
            )
            for a in options:
                for b in options:
                    worse = all(x >= y for x, y in zip(a.metrics(), b.metrics(), strict=True))
                    assert a is b or not worse  # none is matched or beaten everywhere by another
                # The two phases make a plan of the block's own stages, followed by the rest
                # of the chain (a stage that costs nothing) unless the block ends the chain.
                stages = chain.stages[block.start : block.stop]
                rest = block.stop < chain.length
                if rest:
                    stages += (NOTHING,)
                sub = Chain(
                    stages,
                    input_bytes=chain.activation_bytes(block.start),
                    input_requires_grad=chain.requires_grad(block.start),
                )
                forward = [(op, k - block.start) for op, k in a.forward_ops]
                backward = [(op, k - block.start) for op, k in a.backward_ops]
                last = len(block)
                middle = [(Op.FORWARD_ALL, last), (Op.BACKWARD, last)] if rest else []
                cost = simulate(sub, Schedule.from_ops(sub.length, forward + middle + backward))
                assert cost.seconds == pytest.approx(a.seconds)
                assert a.forward_ops[-1][1] == block.stop - 1  # the output is made last
                # Only a forward phase that ends building the last stage's graph pins the output.
                if a.pins_output:
                    assert a.forward_ops[-1] == (Op.FORWARD_ALL, block.stop - 1)


NOTHING = Stage(
    name="rest",
    output_bytes=0,
    saved_bytes=0,
    saves_input=False,
    forward_peak_bytes=0,
    forward_grad_peak_bytes=0,
    backward_peak_bytes=0,
    weight_bytes=0,
    gradient_bytes=0,
    forward_seconds=0.0,
    backward_seconds=0.0,
)


def _stage(name, leaves, **fields):
    return Stage(
        name=name,
        output_bytes=sum(leaves),
        saved_bytes=fields.pop("saved", 1),
        saves_input=True,
        forward_peak_bytes=leaves[-1],
        forward_grad_peak_bytes=leaves[-1] + 1,
        backward_peak_bytes=3,
        weight_bytes=2,
        gradient_bytes=2,
        forward_seconds=1.0,
        backward_seconds=2.0,
        leaf_bytes=leaves if len(leaves) > 1 else (),
        **fields,
    )


def test_identical_blocks_get_their_options_once():
    # A block (4) -> (4, 3) -> (4, 2) -> (4), the skip carried, repeated four times, then a head.
    block = (
        _stage("conv1", (4, 3), carried=((0, 0),)),
        _stage("conv2", (4, 2), carried=((0, 0),), saved_inputs=(1,)),
        _stage("add", (4,), saved=0),
    )
    chain = Chain(block * 4 + (_stage("head", (2,)),), input_bytes=4, input_requires_grad=True)
    blocks_module._options.cache_clear()
    plan = block_plan(chain)
    info = blocks_module._options.cache_info()
    assert [len(b) for b in plan.blocks] == [3, 3, 3, 3, 1]
    assert (info.misses, info.hits) == (2, 3)  # the repeated block once, the head once
    assert len(plan.options[0]) >= 2
    assert [o.metrics() for o in plan.options[0]] == [o.metrics() for o in plan.options[3]]
    assert plan.options[3][0].forward_ops == tuple(
        (op, k + 9) for op, k in plan.options[0][0].forward_ops
    )


def test_an_infeasible_budget_raises_one_line_with_the_smallest_that_works():
    chain = residual_chain(random.Random(4), 3)
    least = minimum_block_memory(chain)
    with pytest.raises(InfeasibleBudget) as caught:
        edgetrain.plan(chain, "blocks", memory=least - 1)
    assert "\n" not in str(caught.value) and caught.value.smallest == least
    schedule = edgetrain.plan(chain, "blocks", memory=least)
    assert schedule.strategy == "blocks"
    assert simulate(chain, schedule).peak_bytes <= least


def test_plan_blocks_gives_the_fastest_fitting_plan_of_the_fine_chain():
    chain = residual_chain(random.Random(6), 3)
    everything = simulate(chain, store_all(chain)).peak_bytes
    least = minimum_block_memory(chain)
    table = block_plan(chain).maker().table(1.0, SLOTS)
    for budget in np.linspace(least, everything, 5):
        schedule = edgetrain.plan(chain, "blocks", memory=float(budget))
        cost = simulate(chain, schedule)
        assert cost.peak_bytes <= budget
        assert cost.seconds <= table.time(math.floor(budget)) + 1e-9
    recompute = edgetrain.plan(chain, "blocks", max_recompute=1.3)
    assert simulate(chain, recompute).recompute_factor <= 1.3 + 1e-9


CASES = [
    ("residual-mlp", ResidualMLP, lambda: torch.randn(16, 12)),
    ("resnet18-module", lambda: build("resnet18-module"), lambda: sample_input("resnet18", 2, 32)),
]


@pytest.mark.parametrize(("name", "make", "make_input"), CASES, ids=[c[0] for c in CASES])
def test_a_captured_residual_model_trains_exactly_under_block_plans(name, make, make_input):
    torch.manual_seed(0)
    model = make().to(F64)
    x = make_input().to(F64)
    chain = analytic_chain(as_stages(model, x), x)
    everything = simulate(chain, store_all(chain)).peak_bytes
    least = minimum_block_memory(chain)
    for budget in ((everything + least) / 2, least):
        schedule = edgetrain.plan(chain, "blocks", memory=budget)
        assert schedule.strategy == "blocks"
        ours, plain = copy.deepcopy(model), copy.deepcopy(model)
        net = Checkpointed(ours, x, chain=chain, schedule=schedule)
        assert torch.equal(train_step(net, x, seed=3), train_step(plain, x, seed=3))
        same_state(ours, plain)
        measured = measured_peak(Checkpointed(model, x, chain=chain, schedule=schedule), x)
        assert measured == pytest.approx(net.cost.peak_bytes, rel=0.05), name
        assert measured <= budget * 1.02


class FlattenedHead(ResidualMLP):
    """The model's output is its head's output through ``nn.Flatten`` (the same storage), as
    timm's classifier heads end."""

    def __init__(self) -> None:
        super().__init__()
        self.flatten = nn.Flatten()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flatten(super().forward(x))


def test_a_model_whose_output_is_a_view_of_its_heads_plans_below_storing_everything():
    torch.manual_seed(0)
    model = FlattenedHead().to(F64)
    x = torch.randn(512, 12, dtype=F64)  # activations, not parameter gradients, set the peak
    chain = analytic_chain(as_stages(model, x), x)
    assert chain.stages[-1].carried  # the last stage's output is its input
    everything = simulate(chain, store_all(chain)).peak_bytes
    assert minimum_block_memory(chain) < 0.6 * everything
    ours, plain = copy.deepcopy(model), copy.deepcopy(model)
    net = Checkpointed(ours, x, chain=chain, memory_budget="min", strategy="blocks")
    assert net.predicted_peak_bytes < net.plain_peak_bytes
    assert torch.equal(train_step(net, x, seed=3), train_step(plain, x, seed=3))
    same_state(ours, plain)


def test_optimal_plans_a_long_chain_over_its_blocks_and_a_short_one_both_ways():
    rng = random.Random(12)
    chain = residual_chain(rng, 1)
    while chain.length <= FLAT_UP_TO:
        more = residual_chain(rng, 10)
        first = more.stages[0]
        # Each new block takes the last block's output as its input (the skip's size).
        width = chain.stages[-1].output_bytes
        first = dataclasses.replace(
            first, leaf_bytes=(width, first.leaf_bytes[1]), output_bytes=width + first.leaf_bytes[1]
        )
        chain = dataclasses.replace(chain, stages=(*chain.stages, first, *more.stages[1:]))
    peak = simulate(chain, store_all(chain)).peak_bytes
    schedule = edgetrain.plan(chain, "optimal", memory=0.6 * peak)
    assert schedule.strategy == "optimal" and schedule.params["over"] == "blocks"
    assert schedule.length == chain.length and simulate(chain, schedule).peak_bytes <= 0.6 * peak
    # A short chain: the better of the flat DP's plan and the block DP's, whichever it is.
    short = dataclasses.replace(chain, stages=chain.stages[:40])
    budget = 0.6 * simulate(short, store_all(short)).peak_bytes
    best = edgetrain.plan(short, "optimal", memory=budget)
    alone = []
    for each in (lambda: fastest(TableMaker(short), budget), lambda: plan_blocks(short, budget)):
        # The flat DP counts the skips at every cut: it may find nothing here.
        with contextlib.suppress(InfeasibleBudget):
            alone.append(simulate(short, each()).seconds)
    assert alone and simulate(short, best).seconds == pytest.approx(min(alone), rel=1e-12)
    assert simulate(short, best).peak_bytes <= budget


def test_a_model_with_more_than_256_cuts_is_cut_at_every_one():
    model = ResidualMLP(width=8, depth=56)
    x = torch.randn(4, 12)
    cuts = all_cuts(capture(model, x))
    assert 256 < len(cuts) <= ALL_CUTS_UP_TO
    assert len(as_stages(model, x)) == len(cuts) + 1


def test_checkpointed_takes_the_blocks_strategy():
    torch.manual_seed(0)
    model = ResidualMLP().to(F64)
    x = torch.randn(512, 12, dtype=F64)  # activations, not parameter gradients, set the peak
    ours, plain = copy.deepcopy(model), copy.deepcopy(model)
    net = Checkpointed(ours, x, max_recompute=1.3, strategy="blocks")
    assert net.schedule.strategy == "blocks" and net.cost.recompute_factor <= 1.3 + 1e-9
    assert net.cost.forward_steps > 0  # it recomputes
    assert torch.equal(train_step(net, x, seed=3), train_step(plain, x, seed=3))
    same_state(ours, plain)
