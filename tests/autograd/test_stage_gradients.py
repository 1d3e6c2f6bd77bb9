"""The gradients a stage's backward receives are held no longer than plain autograd holds them.

* A tensor a stage returns unchanged (a residual skip carried across a cut): its gradient is
  added to the gradient of the stage's own use of it after the engine, in place, as autograd
  adds gradients inside one graph; the result equals plain autograd's bit for bit. Handed to
  the engine as a root gradient that the executor also held and added out of place, it would be
  one more skip-sized tensor at the peak of every stage that opens a residual block.
* An output's gradient is freed as soon as the stage's last operation has read it, not at the
  end of the stage's backward.
"""

import copy

import pytest
import torch
from torch import nn

from edgetrain.autograd.stages import run_backward, run_forward_with_grad
from edgetrain.autograd.storage_counter import StorageCounter, storage_bytes
from edgetrain.frontend.cuts import as_stages
from edgetrain.frontend.fx_capture import capture, live_values, segments
from edgetrain.frontend.profiling import analytic_chain


class OneRead(nn.Module):
    """The skip is read once before the cut (``tanh(a(x))``) and added back after it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.c(h) + x


class TwoReads(nn.Module):
    """The skip is read twice before the cut (``a(x) * b(x)``): three gradient terms, whose
    order of addition decides the last bits."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.b(x)
        return self.c(h) + x


def _staged_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Cut ``model`` where (h, x) is live, just before ``c``, and run the two segments through
    the stage primitives, as the executor does: forward with grad, then backward stage by
    stage."""
    captured = capture(model, x)
    cut = [n.name for n in captured.nodes].index("c")
    assert len(live_values(captured, cut)) == 2
    first, second = segments(captured, [cut])
    out1, graph1 = run_forward_with_grad(first, x, needs_input_grad=True)
    out2, graph2 = run_forward_with_grad(second, out1, needs_input_grad=True)
    del out1
    loss_grad = torch.ones_like(out2)
    (gx,) = run_backward(graph1, run_backward(graph2, [loss_grad]))
    assert gx is not None
    return gx, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("model_type", [OneRead, TwoReads])
def test_gradients_equal_plain_autograd_bitwise(model_type):
    torch.manual_seed(0)
    model = model_type()
    twin = copy.deepcopy(model)
    x = torch.randn(64, 32)

    # Float32 on purpose: summing three terms in another order changes the last bits.
    plain_x = x.clone().requires_grad_()
    twin(plain_x).backward(torch.ones(64, 32))
    gx, _ = _staged_step(model, x)
    assert torch.equal(gx, plain_x.grad)


def test_the_skip_gradient_is_added_in_place():
    torch.manual_seed(0)
    block = nn.Linear(512, 512, bias=False).requires_grad_(False)

    class Carry(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return block(x), x

    x = torch.randn(512, 512)
    size = x.untyped_storage().nbytes()
    with StorageCounter() as counter:
        out, graph = run_forward_with_grad(Carry(), x, needs_input_grad=True)
        grads = [torch.randn_like(t) for t in out]
        expected = grads[0] @ block.weight + grads[1]
        del out
        base = counter.reset_peak()
        (gx,) = run_backward(graph, grads)
        # The linear's input gradient, and nothing else: the skip's gradient goes into it.
        assert counter.peak_bytes - base == size
    assert torch.allclose(gx, expected)


def test_an_output_gradient_is_freed_once_read():
    class TwoOps(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x * 1.0).exp()  # exp saves its result, relu its result

    x = torch.randn(512, 512)
    size = x.untyped_storage().nbytes()
    with StorageCounter() as counter:
        out, graph = run_forward_with_grad(TwoOps(), x, needs_input_grad=True)
        grads: list[torch.Tensor | None] = [torch.randn_like(out)]
        expected = grads[0] * out * (out > 1).to(out.dtype)  # d exp(relu(x)) / dx, x > 0
        del out
        base = counter.reset_peak()
        (gx,) = run_backward(graph, grads)
        # exp's backward makes one tensor; the output's gradient goes before relu's makes another.
        assert counter.peak_bytes - base == size
        assert grads == [None]  # run_backward took the gradient: nothing else holds it
    assert torch.allclose(gx, expected)


class LongSkip(nn.Module):
    """A U-Net in miniature: the encoder's output skips the bottom and is concatenated with the
    upsampled trunk; ``torch.cat``'s backward hands each input a view of one gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 3, padding=1)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.dec = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.enc(x))
        h = torch.relu(self.mid(nn.functional.max_pool2d(skip, 2)))
        h = nn.functional.interpolate(h, scale_factor=2.0)
        return self.dec(torch.cat([h, skip], 1))


class Bottleneck(nn.Module):
    """A ResNet bottleneck as torchvision writes it: narrow 1×1, wide 1×1, BatchNorm,
    ``out += x``, in-place ReLU. The in-place tail is one stage, which makes two gradients of
    its own (the trunk's and the skip's); the stage before it consumes the trunk's and passes
    the skip's on."""

    def __init__(self) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(8, 2, 1)
        self.expand = nn.Conv2d(2, 8, 1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.expand(torch.relu(self.reduce(x))))
        out += x
        return self.relu(out)


@pytest.mark.parametrize(
    ("model", "shape"), [(LongSkip, (2, 3, 8, 8)), (Bottleneck, (2, 8, 6, 6))], ids=["cat", "add"]
)
def test_gradient_bytes_follow_the_storages_a_backward_passes_on(model, shape):
    """After each stage's backward, the gradient tensors held are what the chain says. Through
    a long skip the skip's gradient, a view of the concatenation's, keeps all of it alive; in a
    bottleneck the skip's gradient passed on is the skip's alone (the trunk's, made beside it
    by the same stage, is freed by the stage that consumes it)."""
    torch.manual_seed(0)
    model = model()
    x = torch.randn(*shape, requires_grad=True)
    stages = as_stages(model, x)
    chain = analytic_chain(stages, x)
    assert any(stage.gradient_from for stage in chain.stages)
    value, graphs = x, []
    for stage in stages:
        value, graph = run_forward_with_grad(stage, value, needs_input_grad=True)
        graphs.append(graph)
    grads: list[torch.Tensor | None] = [torch.ones_like(value)]
    del value
    for k in reversed(range(len(graphs))):
        grads = run_backward(graphs.pop(), grads)
        held = storage_bytes([g for g in grads if g is not None])
        assert held == chain.gradient_of_activation_bytes(k), chain.stages[k].name
