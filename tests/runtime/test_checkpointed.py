"""Checkpointed: gradients equal plain autograd's, RNG and BatchNorm state are exact, and the
measured peak is the plan's prediction."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.core.accounting import fixed_training_bytes
from edgetrain.core.schedule import Schedule
from edgetrain.core.simulator import simulate
from edgetrain.errors import CorruptFile, InfeasibleBudget, InvalidInput, InvalidSchedule
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.models import build
from edgetrain.planners.optimal import minimum_memory, store_all
from edgetrain.planners.revolve import revolve
from edgetrain.planners.sequential import sequential
from edgetrain.runtime.checkpointed import Checkpointed
from tests.conftest import small_cnn

PLANS = [
    ("optimal", {"max_recompute": 1.0}),
    ("optimal", {"max_recompute": 1.3}),
    ("optimal", {"max_recompute": 3.0}),
    ("revolve", {"max_recompute": 4.0}),
    ("revolve", {"max_recompute": 1.8}),
    ("sequential", {"max_recompute": 1.5}),
    ("sequential", {}),
]


def reference_step(model, x, seed):
    torch.manual_seed(seed)
    out = model(x)
    (out.square().sum() + out.sum()).backward()
    return out, torch.get_rng_state()


def assert_same_training_state(a: nn.Module, b: nn.Module, rtol: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=0, msg=name)
    for (name, buf), other in zip(a.named_buffers(), b.buffers(), strict=True):
        assert torch.equal(buf, other), name  # running stats and num_batches_tracked


@pytest.mark.parametrize(("strategy", "budget"), PLANS)
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_gradients_rng_and_batchnorm_equal_plain_autograd(strategy, budget, dtype, rtol):
    model = small_cnn(dtype)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8, dtype=dtype, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    # Plans from the analytic chain (FLOP-based times) do not depend on how busy the machine is.
    net = Checkpointed(model, x, chain=analytic_chain(model, x), strategy=strategy, **budget)
    expected, rng_after = reference_step(plain, x_plain, seed=123)
    torch.manual_seed(123)
    out = net(x)
    (out.square().sum() + out.sum()).backward()
    torch.testing.assert_close(out, expected, rtol=rtol, atol=0)
    torch.testing.assert_close(x.grad, x_plain.grad, rtol=rtol, atol=0)
    assert_same_training_state(plain, model, rtol)
    assert torch.equal(torch.get_rng_state(), rng_after)  # the caller's RNG stream goes on as usual


def test_several_steps_with_an_optimizer_stay_identical():
    model = small_cnn(torch.float64)
    plain = copy.deepcopy(model)
    net = Checkpointed(model, torch.randn(4, 3, 8, 8, dtype=torch.float64), max_recompute=1.4)
    opt_a = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
        for module, opt in ((plain, opt_a), (net, opt_b)):
            torch.manual_seed(step)
            opt.zero_grad()
            module(x).logsumexp(1).sum().backward()
            opt.step()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-10, atol=0)
    assert_same_training_state(plain, model, 1e-10)


@settings(max_examples=12, deadline=None)
@given(
    st.integers(2, 7),
    st.floats(1.0, 3.0),
    st.sampled_from(["optimal", "revolve", "sequential"]),
    st.integers(0, 99),
)
def test_random_mlps_train_exactly_under_any_plan(depth, rho, strategy, seed):
    torch.manual_seed(seed)
    widths = [int(w) for w in torch.randint(2, 9, (depth + 1,))]
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(widths[i], widths[i + 1]), nn.Tanh() if i % 2 else nn.Dropout(0.3)]
    model = nn.Sequential(*layers).double()
    plain = copy.deepcopy(model)
    x = torch.randn(5, widths[0], dtype=torch.float64)
    try:
        net = Checkpointed(
            model, x, chain=analytic_chain(model, x), strategy=strategy, max_recompute=rho
        )
    except InfeasibleBudget:
        assert strategy == "revolve"
        return
    reference_step(plain, x, seed)
    torch.manual_seed(seed)
    out = net(x)
    (out.square().sum() + out.sum()).backward()
    assert_same_training_state(plain, model, 1e-10)


@pytest.mark.parametrize("rho", [1.0, 1.25, 2.0])
def test_measured_peak_is_the_predicted_peak(rho):
    model = build("resnet18")
    x = torch.randn(2, 3, 64, 64)
    net = Checkpointed(model, x, max_recompute=rho)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    counter = StorageCounter()
    with counter:
        out = net(x)
        out.sum().backward()
        del out
    assert counter.peak_bytes == pytest.approx(net.cost.peak_bytes, rel=0.01)


def test_a_budget_plans_the_fastest_fitting_schedule_and_too_small_says_what_fits():
    model = build("resnet18")
    x = torch.randn(2, 3, 64, 64)
    plain = Checkpointed(model, x)
    chain = plain.chain
    fixed = plain.fixed_bytes  # the loop planned for: gradients created by the step
    assert not plain.grads_exist and fixed == fixed_training_bytes(chain) - chain.gradient_bytes
    # Budgets hold the tensors and the kernels' scratch (Cost.heap_peak_bytes).
    everything = simulate(chain, store_all(chain)).heap_peak_bytes
    between = int(minimum_memory(chain) + everything) // 2
    tight = Checkpointed(model, x, memory_budget=fixed + between, chain=chain)
    assert simulate(chain, tight.schedule).heap_peak_bytes <= between
    assert tight.cost.recompute_factor > 1
    with pytest.raises(InfeasibleBudget, match="smallest memory that works is") as info:
        Checkpointed(model, x, memory_budget=fixed + 1000, chain=chain)
    assert info.value.smallest is not None and info.value.smallest > fixed
    Checkpointed(model, x, memory_budget=info.value.smallest, chain=chain)  # and it does work
    with pytest.raises(InfeasibleBudget, match="the step starts with") as info:
        Checkpointed(model, x, memory_budget="1MB", chain=chain)
    Checkpointed(model, x, memory_budget=info.value.smallest, chain=chain)


def test_schedule_saves_and_loads_and_a_foreign_plan_is_refused(tmp_path):
    model = small_cnn()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    net = Checkpointed(model, x, max_recompute=1.5)
    path = tmp_path / "plan.json"
    net.schedule.save(path)
    again = Checkpointed(model, x, schedule=Schedule.load(path), chain=net.chain)
    assert again.schedule.text() == net.schedule.text()
    other = Checkpointed(build("resnet18"), torch.randn(2, 3, 32, 32), max_recompute=2.0)
    with pytest.raises(InvalidSchedule, match=r"made for .* re-plan it"):
        Checkpointed(model, x, schedule=other.schedule, chain=net.chain)
    path.write_text(path.read_text()[:-20])
    with pytest.raises(CorruptFile):
        Schedule.load(path)


def test_no_grad_and_eval_just_run_the_model():
    model = small_cnn()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    net = Checkpointed(model, x, max_recompute=2.0)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(net(x), model(x))


def test_backward_twice_is_refused():
    model = small_cnn()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    net = Checkpointed(model, x, max_recompute=2.0)
    out = net(x).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        out.backward()


def test_analytic_chain_plans_run_exactly_too():
    model = small_cnn()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    chain = analytic_chain(model, x)
    net = Checkpointed(model, x, chain=chain, max_recompute=1.5)
    assert simulate(chain, net.schedule).recompute_factor <= 1.5 + 1e-9
    plain = copy.deepcopy(model)
    reference_step(plain, x, 0)
    torch.manual_seed(0)
    out = net(x)
    (out.square().sum() + out.sum()).backward()
    assert_same_training_state(plain, model, 1e-10)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:  # control flow on a value: torch.fx cannot trace it
            return y
        return -y


def test_any_module_runs_and_one_fx_cannot_trace_gets_one_line():
    model = nn.Linear(3, 3).double()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 3, dtype=torch.float64)
    net = Checkpointed(model, x)
    net(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert torch.equal(model.weight.grad, plain.weight.grad)
    with pytest.raises(InvalidInput) as info:
        Checkpointed(DataDependent(), torch.randn(2, 3))
    assert "\n" not in str(info.value)


def test_every_revolve_and_sequential_plan_of_a_cnn_is_exact():
    model = small_cnn(torch.float64)
    x0 = torch.randn(4, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    chain = analytic_chain(model, x0)
    plans = [revolve(chain, s) for s in range(1, chain.length + 1)]
    plans += [sequential(chain, s) for s in range(1, chain.length + 1)]
    for schedule in plans:
        ours, plain = copy.deepcopy(model), copy.deepcopy(model)
        x = x0.detach().clone().requires_grad_()
        x_plain = x0.detach().clone().requires_grad_()
        net = Checkpointed(ours, x, chain=chain, schedule=schedule)
        expected, _ = reference_step(plain, x_plain, seed=5)
        torch.manual_seed(5)
        out = net(x)
        (out.square().sum() + out.sum()).backward()
        assert torch.equal(out, expected), schedule.text()
        assert torch.equal(x.grad, x_plain.grad), schedule.text()
        assert_same_training_state(plain, ours, 0.0)


class _FailsOnDemand(nn.Module):
    """A Linear layer (with a tied twin) that raises in a forward with grad while ``fail`` is set
    (where the executor runs it on leaves of its own in place of the parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.twin = self.linear  # the same module under a second name
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail and torch.is_grad_enabled():
            raise RuntimeError("failing on demand")
        return self.twin(torch.tanh(self.linear(x)))


def test_a_stage_that_raises_leaves_the_models_own_parameters_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), _FailsOnDemand(), nn.Tanh(), nn.Linear(6, 3))
    model = model.double()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 6, dtype=torch.float64)
    chain = analytic_chain(model, x)
    net = Checkpointed(model, x, chain=chain, schedule=revolve(chain, 1))  # recomputes stages
    before = dict(model.named_parameters(remove_duplicate=False))
    model[2].fail = True
    with pytest.raises(RuntimeError, match="failing on demand"):
        net(x).sum().backward()
    for name, p in model.named_parameters(remove_duplicate=False):
        assert p is before[name] and isinstance(p, nn.Parameter), name
    model[2].fail = False
    reference_step(plain, x, seed=5)
    torch.manual_seed(5)
    out = net(x)
    (out.square().sum() + out.sum()).backward()
    assert_same_training_state(plain, model, 1e-10)
