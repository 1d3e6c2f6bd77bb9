"""The contract when what a plan was made for changes during training, and for models users
write that the other contract tests do not: a layer unfrozen or frozen,
an input gradient wanted, the train/eval mode switched, or the batch size changed after
planning; a dict output whose auxiliary head the loss does not use; a model with two inputs, or
one returning its input. Each compares with plain autograd on a deepcopy, on the same inputs and
RNG state (float64)."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import edgetrain
from edgetrain.core.schedule import Op, Schedule
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.planners.optimal import minimum_memory
from edgetrain.runtime.checkpointed import Checkpointed
from tests.helpers import step_peak

F64 = torch.float64
MERGE = pytest.mark.parametrize("merge", [True, False], ids=["merged", "stage-by-stage"])


def user_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Dropout(0.3),
        nn.Linear(64, 64),
        nn.SiLU(),
        nn.BatchNorm1d(64),
        nn.Linear(64, 4),
    ).to(F64)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum() + out.sum()


def step(module: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    out = module(x)
    loss_of(out).backward()
    return out


def tightest(model: nn.Module, x: torch.Tensor, merge: bool = True) -> Checkpointed:
    """``model`` under the optimal plan at the least memory that works (the profiled chain)."""
    chain = Checkpointed(copy.deepcopy(model), x, merge_graph_runs=merge).chain
    schedule = edgetrain.plan(chain, "optimal", memory=minimum_memory(chain))
    return Checkpointed(model, x, chain=chain, schedule=schedule, merge_graph_runs=merge)


def same_grads(plain: nn.Module, ours: nn.Module) -> None:
    for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


@MERGE
def test_a_layer_unfrozen_after_planning_gets_plain_autograds_gradient(merge):
    """Fine-tuning: the first layer is frozen when Checkpointed plans, unfrozen after a step.
    Plain autograd then gives it a gradient; so does the executor, which plans again for the
    parameters that now need one (``.grad`` is not left None)."""
    model, x = user_mlp(), torch.randn(256, 8, dtype=F64)
    model[0].requires_grad_(False)
    plain, ours = copy.deepcopy(model), copy.deepcopy(model)
    net = tightest(ours, x, merge)
    assert net.runs_as != "the module itself"
    for module, run in ((plain, plain), (ours, net)):
        step(run, x, 1)
        module[0].requires_grad_(True)
        step(run, x, 2)
    same_grads(plain, ours)


def test_an_input_gradient_wanted_after_planning_is_plain_autograds():
    """Planned on an input that needs no gradient, with a frozen first layer; later the loop asks
    for the input's gradient (saliency, adversarial examples): the executor plans again and
    gives it, as plain autograd does (``x.grad`` stayed None before)."""
    model, x = user_mlp(), torch.randn(256, 8, dtype=F64)
    model[0].requires_grad_(False)
    plain, ours = copy.deepcopy(model), copy.deepcopy(model)
    net = tightest(ours, x, merge=False)
    xp, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    assert torch.equal(step(plain, xp, 1), step(net, xo, 1))
    same_grads(plain, ours)
    assert xo.grad is not None and torch.equal(xp.grad, xo.grad)


def test_a_layer_frozen_after_planning_trains_like_plain_autograd_in_a_checkpointed_segment():
    """The plan runs a checkpointed segment (torch.utils.checkpoint in a GraphRunModule); a
    layer is frozen after planning: the forward runs it on the executor's parameter leaves
    (trainable when planned), the recomputation on the frozen parameters, and a backward of
    the old plan would raise torch.utils.checkpoint's CheckpointError. The step plans again for
    the frozen layer and trains as plain autograd does."""
    model, x = user_mlp(), torch.randn(256, 8, dtype=F64)
    chain = Checkpointed(copy.deepcopy(model), x).chain
    # The optimal plan at a quarter of the way from the least memory to storing everything
    # (written out: the planner's choice depends on measured times). Its first four stages
    # (Linear, Tanh, Linear, GELU) are one checkpointed segment, run as one stage.
    text = "Fc0 Fn1 Fn2 Fn3 Fc4 Fn5 Fn6 Fa7 Fa8 B8 B7 Fa4 Fa5 Fa6 D7 B6 B5 B4 Fa0 Fa1 Fa2 Fa3 D4"
    kinds = {"Fa": Op.FORWARD_ALL, "Fc": Op.FORWARD_CHECKPOINT, "Fn": Op.FORWARD_NOSAVE}
    kinds |= {"B": Op.BACKWARD, "D": Op.DISCARD}
    ops = [(kinds[t.rstrip("0123456789")], int(t.lstrip("FacnBD"))) for t in text.split()]
    ops += [(Op.BACKWARD, k) for k in (3, 2, 1, 0)]
    schedule = Schedule.from_ops(chain.length, ops)
    plain, ours = copy.deepcopy(model), copy.deepcopy(model)
    net = Checkpointed(ours, x, chain=chain, schedule=schedule)
    assert net.runs_as == "5 stages" and type(net._exec_stages[0]).__name__ == "GraphRunModule"
    for module, run in ((plain, plain), (ours, net)):
        module[2].requires_grad_(False)
        step(run, x, 1)
    same_grads(plain, ours)


def test_a_given_plan_runs_again_when_the_planned_batch_size_comes_back():
    """A given plan (``schedule=``), one smaller batch (planned for the memory the given plan
    was made for, not for storing everything), then the planned batch size again: the given
    plan runs again (not plain autograd in its place)."""
    model, x = user_mlp(), torch.randn(256, 8, dtype=F64)
    chain = Checkpointed(copy.deepcopy(model), x).chain
    schedule = edgetrain.plan(chain, "optimal", memory=minimum_memory(chain))
    net = Checkpointed(model, x, chain=chain, schedule=schedule)
    planned = net.cost.peak_bytes
    for batch in (x, x[:64], x):
        step(net, batch, 0)
        assert net.cost.peak_bytes <= planned or batch is x
    assert net.schedule.text() == schedule.text()
    assert net._costs[False].peak_bytes == planned  # the loop that sets gradients to None


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.e = nn.Linear(16, 64), nn.Linear(5, 64)
        self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x)) * torch.sigmoid(self.e(y))
        h = torch.tanh(self.b(h))
        return self.c(F.silu(self.b(h)) + h)


class PairInput(TwoInputs):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(pair[0], pair[1])


def test_a_model_with_two_positional_inputs_trains_or_is_refused_with_one_clear_error():
    """A captured model is called with one input tensor; ``forward(self, x, y)`` with a tuple
    sample is one clear error, not a bare TypeError from profiling."""
    torch.manual_seed(0)
    model = TwoInputs().to(F64)
    sample = (torch.randn(64, 16, dtype=F64), torch.randn(64, 5, dtype=F64))
    plain = copy.deepcopy(model)
    with pytest.raises(InvalidInput, match="one input tensor; the sample is a tuple"):
        Checkpointed(model, sample, max_recompute=3.0)
    del plain


def test_a_captured_model_taking_a_tuple_is_refused_with_one_clear_error():
    """Tuple, list and dict inputs pass between the entries of an ``nn.Sequential``; a model
    captured with torch.fx takes one tensor, and a tuple sample gets one line saying so."""
    torch.manual_seed(0)
    model = PairInput().to(F64)
    x = (torch.randn(64, 16, dtype=F64), torch.randn(64, 5, dtype=F64))
    with pytest.raises(InvalidInput, match="one input tensor; the sample is a tuple"):
        Checkpointed(model, x, max_recompute=3.0)


class ReturnsInput(nn.Module):
    """Residual GELU blocks that return their input along with the head's output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        for block in self.blocks:
            h = F.gelu(block(h)) + h
        y = self.c(F.silu(self.b(F.gelu(self.b(h)) + h)))
        return x, y


@pytest.mark.parametrize("kwargs", [{"max_recompute": 3.0}, {"memory_budget": 0.6}])
def test_a_model_returning_its_input_is_planned_or_refused_clearly(kwargs):
    """``return x, head(x)`` (the input among the outputs): one line names the construct and
    the fix, whatever the budget form (not a bare numpy ValueError from the planner)."""
    torch.manual_seed(0)
    model, x = ReturnsInput().to(F64), torch.randn(512, 16, dtype=F64)
    with pytest.raises(InvalidInput, match="returns its input 'x' itself"):
        Checkpointed(model, x, **kwargs)


class TwoHeads(nn.Module):
    """A trunk and two heads, returned in a dict (a main and an auxiliary output)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 64)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.main, self.aux = nn.Linear(64, 4), nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.a(x))
        for block in self.blocks:
            h = F.gelu(block(h)) + h
        return {"main": self.main(h), "aux": self.aux(torch.tanh(h))}


def test_an_output_the_loss_does_not_use_leaves_its_heads_gradients_none_in_one_graph():
    """The loss uses only ``out["main"]``: plain autograd leaves the auxiliary head's ``.grad``
    None, and so does a plan run as one graph (it gave zeros before, which AdamW's weight decay
    and moments would act on)."""
    from tests.runtime.test_contract import _checkpointed_plan

    torch.manual_seed(0)
    model, x = TwoHeads().to(F64), torch.randn(512, 8, dtype=F64)
    chain = Checkpointed(copy.deepcopy(model), x).chain
    plain, ours = copy.deepcopy(model), copy.deepcopy(model)
    net = Checkpointed(ours, x, chain=chain, schedule=_checkpointed_plan(chain.length, {1: 4}))
    assert net.runs_as == "one graph"
    for run in (plain, net):
        torch.manual_seed(0)
        run(x)["main"].square().sum().backward()
    assert plain.aux.weight.grad is None
    same_grads(plain, ours)


def test_a_model_planned_in_eval_mode_is_planned_again_for_training_within_its_budget():
    """Built in eval mode (just validated or loaded), trained after ``train()``: the profile ran
    Dropout as the identity, so the old plan would hold about 20 % more than predicted. The
    mode is part of what a plan is made for: with a memory budget the step plans again within it and
    holds what it predicts; a given plan's memory that no train-mode plan fits is one clear
    error naming the mode."""
    model, x = user_mlp(), torch.randn(256, 8, dtype=F64)
    model.eval()
    net = tightest(copy.deepcopy(model), x)
    net.train()
    with pytest.raises(InfeasibleBudget, match="another train/eval mode"):
        step(net, x, 0)
    with pytest.raises(InfeasibleBudget, match="another train/eval mode"):
        step(net, x, 0)  # refused again, not run half planned
    net.eval()
    with torch.no_grad():
        net(x)
    net.train(False)  # back to the mode it was planned in: its plan runs again
    step(net, x, 0)
    assert net.runs_as != "the module itself"
    probe = Checkpointed(copy.deepcopy(model).train(), x)
    budget = probe.fixed_bytes + (probe.plain_cost.peak_bytes * 3) // 4
    net = Checkpointed(model, x, memory_budget=budget)
    net.train()
    step(net, x, 0)  # plans for train mode (the profile runs in this step, counted apart)
    assert (
        step_peak(net, x, backward=lambda out: loss_of(out).backward()) <= net.cost.peak_bytes + 64
    ), net.runs_as
    assert net.fixed_bytes + net.cost.peak_bytes <= budget


class SelfAttentionLike(nn.Module):
    """A residual block whose stage reads its input three times (a product with itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a = nn.Linear(16, 32), nn.Linear(32, 32)
        self.ff, self.out = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + F.softmax(self.a(h) @ h.transpose(1, 2), -1) @ h
        h = h + F.gelu(self.ff(h))
        return self.out(h)


@MERGE
def test_a_stage_reading_its_input_thrice_holds_what_the_plan_predicts_with_kept_gradients(
    merge,
):
    """In the loop that keeps gradients, the stage ``softmax(a(h) @ hᵀ) @ h`` (no parameters,
    passes ``h`` on) measures 13440 B for its backward against 23680 B when gradients are
    created, and the executor's backward of it holds the latter (3216 B more in the step). A
    stage's kept-gradient peak is at least its other peak less the gradients it creates.
    (``nn.MultiheadAttention``'s stage, with parameters, is 5264 B over: open.)"""
    torch.manual_seed(0)
    model, x = SelfAttentionLike().to(F64), torch.randn(4, 10, 16, dtype=F64)
    net = Checkpointed(copy.deepcopy(model), x, merge_graph_runs=merge)
    chain = net.chain
    schedule = edgetrain.plan(
        chain, "optimal", memory=minimum_memory(chain, grads_exist=True), grads_exist=True
    )
    net = Checkpointed(
        copy.deepcopy(model), x, chain=chain, schedule=schedule, merge_graph_runs=merge
    )
    assert net.runs_as != "the module itself"
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    assert (
        step_peak(net, x, backward=lambda out: loss_of(out).backward()) <= net.cost.peak_bytes + 64
    ), net.runs_as


class Residual(nn.Module):
    """A captured model (not an nn.Sequential): residual GELU blocks, a head, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.drop, self.head = nn.Dropout(0.2), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        for block in self.blocks:
            h = h + F.gelu(block(h))
        return self.head(self.drop(h))


@MERGE
def test_a_gan_style_loop_freezing_a_part_every_other_step_trains_like_plain_autograd(
    merge, monkeypatch
):
    """A GAN's discriminator is frozen on every other step (while the generator trains) and a
    last batch is smaller: each change of state runs the plan made for that state (made once,
    then kept), and four steps of plain SGD end with plain autograd's weights, bitwise."""
    torch.manual_seed(0)
    model, x = Residual().to(F64), torch.randn(64, 8, dtype=F64)
    model.blocks.requires_grad_(False)  # planned while frozen: unfreezing needs a new plan
    plain, ours = copy.deepcopy(model), copy.deepcopy(model)
    probe = Checkpointed(copy.deepcopy(model), x, merge_graph_runs=merge)
    monkeypatch.setenv("EDGETRAIN_STAGE_SECONDS", "0")  # a plan that recomputes, not store-all
    net = Checkpointed(ours, x, max_recompute=1.5, chain=probe.chain, merge_graph_runs=merge)
    assert net.runs_as != "the module itself"
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, ours)]
    batches = [x, x.flip(0), x, x[:48]]
    for i, batch in enumerate(batches):
        for module, run, optimizer in zip((plain, ours), (plain, net), optimizers, strict=True):
            module.blocks.requires_grad_(i % 2 == 1)
            optimizer.zero_grad()
            step(run, batch, i)
            optimizer.step()
        same_grads(plain, ours)
    # two freezing states at 64, one at 48, each planned for the loop its steps run in only
    assert len({key[:-1] for key in net._plans}) == 3
    assert len(net._plans) == 3
    for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_every_attribute_a_plan_sets_up_is_restored_with_its_state():
    """Coming back to a state restores what its plan set up (its kept
    :class:`~edgetrain.runtime.prepared.PreparedPlan`): an attribute that planning for another
    state changes, and that the kept plan does not hold, would stay at the other state's value.
    Planning for a new state changes nothing else."""
    torch.manual_seed(0)
    model, x = Residual().to(F64), torch.randn(64, 8, dtype=F64)
    net = Checkpointed(model, x, max_recompute=1.5)

    def identities() -> dict[str, int]:
        return {name: id(value) for name, value in (vars(net) | dict(net._modules)).items()}

    before = identities()
    step(net, x[:48], 0)  # another state: planned for
    after = identities()
    changed = {name for name in after if after[name] != before.get(name)}
    bookkeeping = {"_grads_exist", "_unplanned"}  # per step, not per plan
    assert changed - bookkeeping  # the test sees a new plan
    net.zero_grad(set_to_none=True)  # the loop planned for first
    step(net, x, 1)  # back to the first state: its plan as it was
    back = identities()
    restored = {name for name in changed - bookkeeping if back.get(name) == before.get(name)}
    assert changed - bookkeeping <= restored, changed - bookkeeping - restored
