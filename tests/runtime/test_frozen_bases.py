"""Fine-tuning a frozen base: a trainable head on a frozen CNN backbone, LoRA adapters (a frozen
``nn.Linear`` plus a trainable low-rank ``B @ A``) in a frozen transformer, a frozen block in
the middle used twice. What a frozen layer needs no gradient for it does not save, its stages
before the first trainable parameter need no backward, gradients and optimizer state are
those of the trainable parameters only; and each plan trains exactly as plain autograd does
(float64, bitwise) in the user's ``optimizer.zero_grad()`` loop, holding what it predicts."""

import copy

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.core.accounting import fixed_training_bytes, optimizer_state_bytes
from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import simulate
from edgetrain.frontend.cuts import as_stages
from edgetrain.frontend.profiling import analytic_chain, profile_chain
from edgetrain.models.tiny_lm import TinyLM
from edgetrain.planners.optimal import minimum_memory, store_all
from edgetrain.planners.search import frontier
from edgetrain.runtime.checkpointed import Checkpointed

F64 = torch.float64


class LoRA(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-``rank`` update: ``base(x) + x A^T B^T``."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        dtype = base.weight.dtype
        # B is not zero (as LoRA starts it) so that both adapters get a gradient to compare.
        self.a = nn.Parameter(torch.randn(rank, base.in_features, dtype=dtype) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank, dtype=dtype) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def lora_lm() -> tuple[nn.Module, torch.Tensor]:
    """A frozen TinyLM (embedding, attention, MLP, head) with LoRA on every attention layer."""
    torch.manual_seed(0)
    model = TinyLM(vocab=64, context=16, dim=32, depth=1, heads=2).to(F64)
    model.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv = LoRA(block.attn.qkv)
        block.attn.proj = LoRA(block.attn.proj)
    return model, torch.randint(0, 64, (4, 16))


def head_on_frozen_cnn() -> tuple[nn.Module, torch.Tensor]:
    """A frozen Conv/BatchNorm/ReLU backbone (BatchNorm still in training mode) and a
    trainable classifier."""
    torch.manual_seed(1)
    layers: list[nn.Module] = []
    for cin, cout in ((3, 8), (8, 8), (8, 16)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
    backbone = nn.Sequential(*layers).requires_grad_(False)
    model = nn.Sequential(
        *backbone, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10), nn.Tanh()
    )
    return model.to(F64), torch.randn(4, 3, 10, 10, dtype=F64)


def frozen_middle_reused() -> tuple[nn.Module, torch.Tensor]:
    """Trainable layers around a frozen block that runs twice."""
    torch.manual_seed(2)
    middle = nn.Sequential(nn.Linear(16, 16), nn.GELU()).requires_grad_(False)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), middle, middle, nn.Linear(16, 4))
    return model.to(F64), torch.randn(32, 8, dtype=F64)


MODELS = pytest.mark.parametrize(
    "make", [lora_lm, head_on_frozen_cnn, frozen_middle_reused], ids=["lora", "head", "middle"]
)


def trainable_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def no_backward_prefix(chain) -> int:
    """How many leading stages need no backward: nothing trainable in them, no gradient in."""
    k = 0
    while k < chain.length and not chain.requires_grad(k + 1):
        k += 1
    return 0 if chain.input_requires_grad else k


@MODELS
def test_gradients_and_optimizer_state_are_counted_for_trainable_parameters_only(make):
    model, x = make()
    chain = analytic_chain(model, x)
    trained = trainable_bytes(model)
    assert 0 < trained < chain.weight_bytes
    assert chain.gradient_bytes == trained
    assert optimizer_state_bytes(chain, "adam") == 2 * trained
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    fixed = fixed_training_bytes(chain, "adam")
    assert fixed == chain.weight_bytes + 3 * trained + buffers + chain.input_bytes


@MODELS
def test_stages_before_the_first_trainable_parameter_save_nothing_and_need_no_backward(make):
    model, x = make()
    chain = analytic_chain(model, x)
    prefix = no_backward_prefix(chain)
    if make is frozen_middle_reused:
        assert prefix == 0  # its first layer trains
    else:
        assert prefix >= 1
    for stage in chain.stages[:prefix]:
        assert stage.saved_bytes == 0 and not stage.saves_input and not stage.saves_output
        assert stage.gradient_bytes == 0 and stage.backward_peak_bytes == 0
        assert stage.backward_seconds == 0.0
    measured = profile_chain(as_stages(model, x), x, repeats=1)
    for stage in measured.stages[:prefix]:
        assert stage.saved_bytes == 0 and stage.backward_seconds == 0.0


def test_a_frozen_linear_saves_only_what_its_input_gradient_needs_measured_and_from_shapes():
    """A trainable Linear keeps its input for its weight's gradient; a frozen one whose input
    needs a gradient keeps nothing of it (its input's gradient needs the weight alone). The
    profile measures what autograd keeps, and sizing on meta tensors finds the same."""
    model, x = frozen_middle_reused()
    measured = profile_chain(model, x, repeats=1)
    shapes = analytic_chain(model, x)
    trainable = profile_chain(copy.deepcopy(model).requires_grad_(True), x, repeats=1)
    for frozen, trained in zip(measured.stages, trainable.stages, strict=True):
        if frozen.name in ("2", "3"):  # the frozen block, run twice: Linear then GELU
            assert not frozen.saves_input and trained.saves_input, frozen.name
            assert frozen.gradient_bytes == 0
        else:
            assert frozen.saves_input == trained.saves_input, frozen.name
    for a, b in zip(measured.stages, shapes.stages, strict=True):
        assert (a.saved_bytes, a.saves_input, a.saves_output) == (
            b.saved_bytes,
            b.saves_input,
            b.saves_output,
        ), a.name


def optimizer_steps(module, params, x, steps=2):
    """The user's loop, PyTorch's defaults: zero_grad() (gradients to None), backward, step.
    Returns the measured peak of the last step above what it started with."""
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    peak = 0
    for _ in range(steps):
        optimizer.zero_grad()
        torch.manual_seed(7)
        counter = StorageCounter()
        with counter:
            out = module(x)
            loss = out.square().mean()
            loss.backward()
            del out, loss
        peak = counter.peak_bytes
        optimizer.step()
    return peak


@MODELS
def test_plans_on_a_frozen_base_train_like_plain_autograd_and_hold_their_prediction(make):
    model, x = make()
    chain = analytic_chain(model, x)
    least = minimum_memory(chain)
    everything = simulate(chain, store_all(chain)).peak_bytes
    for budget in (least, (least + everything) / 2):
        schedule = edgetrain.plan(chain, "optimal", memory=budget)
        reference, ours = copy.deepcopy(model), copy.deepcopy(model)
        net = Checkpointed(ours, x, chain=chain, schedule=schedule)
        optimizer_steps(reference, [p for p in reference.parameters() if p.requires_grad], x)
        measured = optimizer_steps(net, [p for p in ours.parameters() if p.requires_grad], x)
        predicted = net.cost.peak_bytes
        assert predicted <= budget + 1
        # Run as one graph, plain autograd frees the output's gradient once read (the
        # prediction holds it to the end, as the executor does stage by stage).
        output = chain.stages[-1].output_bytes if net._one_graph else 0
        assert predicted - output - 64 <= measured <= predicted + 64, schedule.text()
        for (name, p), q in zip(reference.named_parameters(), ours.parameters(), strict=True):
            assert torch.equal(p, q), name
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or p.requires_grad)
            assert p.grad is None or torch.equal(p.grad, q.grad), name
        for (name, a), b in zip(reference.named_buffers(), ours.buffers(), strict=True):
            assert torch.equal(a, b), name


def prefix_run_once(chain: Chain, prefix: int, suffix_plan: Schedule) -> Schedule:
    """The plan that runs the stages needing no backward once (their graphs hold nothing),
    holds their output and runs ``suffix_plan`` (a plan of the other stages) on it."""
    ops = [(Op.FORWARD_ALL, k) for k in range(prefix)]
    ops += [(op, k + prefix) for op, k in suffix_plan]
    ops += [(Op.BACKWARD, k) for k in reversed(range(prefix))]
    return Schedule.from_ops(chain.length, ops)


@pytest.mark.parametrize("make", [lora_lm, head_on_frozen_cnn], ids=["lora", "head"])
def test_the_planner_runs_a_frozen_prefix_again_only_where_holding_its_output_costs_memory(make):
    """The stages before the first trainable parameter cost the planner nothing to keep as a
    graph, so at every budget its plan is as fast as running them once and planning the rest
    on their held output (to the dynamic program's slot rounding); it runs them again only
    below the memory that holding their output needs."""
    model, x = make()
    chain = analytic_chain(model, x)
    prefix = no_backward_prefix(chain)
    rest = Chain(chain.stages[prefix:], chain.activation_bytes(prefix), False)
    ours = frontier(chain).points
    held = [
        simulate(chain, prefix_run_once(chain, prefix, p.schedule)) for p in frontier(rest).points
    ]
    for cost in held:
        fastest = min(p.seconds for p in ours if p.peak_bytes <= cost.peak_bytes)
        assert fastest <= cost.seconds * 1.005, cost
    for point in ours:
        runs = [sum(op.is_forward for op, j in point.schedule if j == k) for k in range(prefix)]
        if point.peak_bytes < min(c.peak_bytes for c in held):
            assert max(runs) > 1, point.schedule.text()
        elif make is head_on_frozen_cnn:  # its backbone's output is small: always held
            assert max(runs) == 1, point.schedule.text()


def test_a_device_budget_fits_the_head_fine_tune_where_full_training_is_refused():
    model, x = head_on_frozen_cnn()
    fine_tune = analytic_chain(model, x)
    full = analytic_chain(copy.deepcopy(model).requires_grad_(True), x)
    need_fine = fixed_training_bytes(fine_tune, "adam") + minimum_memory(fine_tune)
    need_full = fixed_training_bytes(full, "adam") + minimum_memory(full)
    assert need_fine < need_full
    reserve = optimizer_state_bytes(fine_tune, "adam")
    net = Checkpointed(model, x, chain=fine_tune, memory_budget=need_fine, reserve_bytes=reserve)
    assert net.cost.peak_bytes <= need_fine
    trained = copy.deepcopy(model).requires_grad_(True)
    with pytest.raises(edgetrain.InfeasibleBudget):
        Checkpointed(
            trained,
            x,
            chain=full,
            memory_budget=need_fine,
            reserve_bytes=optimizer_state_bytes(full, "adam"),
        )
    assert Op.BACKWARD in {op for op, _ in net.schedule}
