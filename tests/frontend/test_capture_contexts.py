"""What a user's ``forward()`` does besides calling layers, which torch.fx does not record:
a ``torch.no_grad()`` block (a frozen backbone, a distillation
teacher), a ``torch.autocast(enabled=False)`` region (an fp32 head in a bf16 step), a Python
attribute the loop changes after planning (a softmax temperature), and a value ``forward()``
stores on a module (an MoE's auxiliary loss). Each goes silently wrong if fx's trace is taken
as it is: gradients for the frozen part, a bf16 head, a stale temperature, a training step that
does nothing. Compared with
plain autograd on a deepcopy, on the same inputs and RNG state."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from edgetrain.errors import InvalidInput
from edgetrain.runtime.checkpointed import Checkpointed
from tests.helpers import step_peak

F64 = torch.float64
MERGE = pytest.mark.parametrize("merge", [True, False], ids=["merged", "stage-by-stage"])


def mlp(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(i, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU(),
        nn.Linear(64, o),
    )  # fmt: skip


class FrozenBackbone(nn.Module):
    """Transfer learning as written in tutorials: features under ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = mlp(16, 64), mlp(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = self.backbone(x)
        return self.head(features)


class Distill(nn.Module):
    """A student and a teacher whose output is computed under ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = mlp(16, 5), mlp(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        return self.student(x) - target


@MERGE
@pytest.mark.parametrize("make", [FrozenBackbone, Distill])
def test_a_no_grad_block_in_forward_gets_no_gradients_at_any_plan(make, merge):
    torch.manual_seed(0)
    model = make().to(F64)
    x = torch.randn(256, 16, dtype=F64)
    for plan in ({"max_recompute": 1.3}, {"max_recompute": 2.0}, {"max_recompute": 5.0}):
        reference, ours = copy.deepcopy(model), copy.deepcopy(model)
        net = Checkpointed(ours, x, **plan, merge_graph_runs=merge)
        plain_peak = step_peak(reference, x, kept=False, params=list(reference.parameters()))
        measured = step_peak(net, x, kept=False, params=list(ours.parameters()))
        assert net.cost.recompute_factor > 1 and net.runs_as != "the module itself"
        assert measured <= net.cost.peak_bytes + 64, (plan, net.runs_as)
        assert measured <= plain_peak + 64
        for (name, p), q in zip(reference.named_parameters(), ours.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), (plan, net.runs_as, name)
            assert p.grad is None or torch.equal(p.grad, q.grad), (plan, name)
    frozen = FrozenBackbone.__name__ == type(model).__name__
    assert all(p.grad is None for p in (ours.backbone if frozen else ours.teacher).parameters())


class Fp32Head(nn.Module):
    """A bf16 body and a head kept in fp32 with ``torch.autocast(enabled=False)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.autocast("cpu", enabled=False):
            return self.head(h.float())


@pytest.mark.parametrize("rho", [1.0, 2.0])
def test_an_autocast_region_in_forward_keeps_its_precision(rho):
    torch.manual_seed(0)
    model = Fp32Head()
    x = torch.randn(64, 16)
    reference, ours = copy.deepcopy(model), copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net = Checkpointed(ours, x, max_recompute=rho)
        expected, got = reference(x), net(x)
    assert net.runs_as != "the module itself"  # the captured stages, the region's nodes in one
    assert got.dtype == expected.dtype == torch.float32
    assert torch.equal(got, expected)
    expected.square().sum().backward()
    got.square().sum().backward()
    for (name, p), q in zip(reference.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class Tempered(nn.Module):
    """A softmax with a temperature the training loop anneals."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(16, 10)
        self.tau = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.body(x) / self.tau, dim=-1)


class PrivatelyTempered(nn.Module):
    """The same with the temperature kept as a ``_private`` attribute behind a property."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(16, 10)
        self._tau = 1.0

    @property
    def tau(self) -> float:
        return self._tau

    @tau.setter
    def tau(self, value: float) -> None:
        self._tau = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.body(x) / self._tau, dim=-1)


@pytest.mark.parametrize("make", [Tempered, PrivatelyTempered])
def test_a_python_attribute_changed_after_planning_is_planned_for_again(make):
    torch.manual_seed(0)
    model = make().to(F64)
    x = torch.randn(64, 16, dtype=F64)
    reference, ours = copy.deepcopy(model), copy.deepcopy(model)
    net = Checkpointed(ours, x, max_recompute=2.0)
    assert net.runs_as != "the module itself"  # a captured plan, with tau traced in
    for tau in (0.5, 0.25, 0.5):
        reference.tau = ours.tau = tau
        for module in (reference, net):
            module(x).square().sum().backward()
        for (name, p), q in zip(reference.named_parameters(), ours.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (tau, name)
    # tau 1.0 (built), 0.5 (planned again once), 0.25; each state for both training loops
    assert len({key[:-1] for key in net._plans}) == 3

    strict = Checkpointed(copy.deepcopy(model), x, max_recompute=2.0, on_new_shape="error")
    strict.module.tau = 0.5
    with pytest.raises(InvalidInput, match="module attribute"):
        strict(x)


class Routed(nn.Module):
    """A mixture-of-experts layer that keeps its load-balancing loss on itself for the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 4)
        self.experts = nn.ModuleList(mlp(32, 32) for _ in range(4))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        self.aux_loss = (probs.mean(0) ** 2).sum()
        return sum(probs[:, e : e + 1] * expert(x) for e, expert in enumerate(self.experts))


class RoutedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.moe, self.head = nn.Linear(8, 32), Routed(), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.inp(x)))


def test_a_value_forward_stores_on_a_module_is_refused_and_the_module_is_left_as_it_was():
    """Captured as it is, the attribute would be an fx Proxy: the loop's ``loss + moe.aux_loss``
    would be no tensor, and its backward would leave every gradient None without a word."""
    model = RoutedNet()
    aux = model.moe.aux_loss
    with pytest.raises(InvalidInput, match=r"assigns to moe\.aux_loss") as error:
        Checkpointed(model, torch.randn(16, 8), max_recompute=2.0)
    assert "\n" not in str(error.value)
    assert model.moe.aux_loss is aux


class Counting(nn.Module):
    """A layer that counts its calls for a warm-up: eager PyTorch counts every step, the
    captured step would count none."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(16, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.body(x) * min(1.0, self.calls / 100)


def test_a_counter_forward_increments_is_refused_and_left_as_it_was():
    model = Counting()
    with pytest.raises(InvalidInput, match="assigns to calls"):
        Checkpointed(model, torch.randn(8, 16), max_recompute=2.0)
    assert model.calls == 0


class Stepped(Tempered):
    """A model the loop keeps a step counter on, which ``forward()`` does not read."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0


def test_an_attribute_forward_does_not_read_plans_nothing_again():
    torch.manual_seed(0)
    model = Stepped().to(F64)
    x = torch.randn(64, 16, dtype=F64)
    net = Checkpointed(model, x, max_recompute=2.0, on_new_shape="error")
    for step in range(1, 4):
        model.step = step  # the loop's counter: no replan, and on_new_shape="error" stays quiet
        net(x).square().sum().backward()
    assert len({key[:-1] for key in net._plans}) == 1  # one state, both training loops
    assert [name for _, name in net.model.traced_reads] == ["tau"]


class LazyHead(nn.Module):
    """A head made on the first call, as some users write lazy layers."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "head"):
            self.head = nn.Linear(8, 3)
        return self.head(self.body(x))


def test_a_submodule_made_in_forward_is_refused_and_the_model_left_whole():
    model = LazyHead()
    with pytest.raises(InvalidInput, match="assigns to head"):
        Checkpointed(model, torch.randn(8, 16), max_recompute=2.0)
    assert "head" not in dict(model.named_children())
    repr(model)  # the model is whole: its registries were put back, not emptied
    assert model(torch.randn(4, 16)).shape == (4, 3)  # and runs eagerly as before


class FailsInside(nn.Module):
    """A layer inside an autocast region that does not fit the sample."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.lin(x)


def test_an_error_inside_a_region_leaves_autocast_and_grad_mode_as_they_were():
    """The region is one module entered with ``with``: an exception inside it still runs its
    exit, so autocast is not left on in the thread after such a capture."""
    with pytest.raises(InvalidInput, match="does not run on the sample"):
        Checkpointed(FailsInside(), torch.randn(2, 8), max_recompute=2.0)
    assert not torch.is_autocast_enabled("cpu")
    assert torch.is_grad_enabled()
