"""Capture: any nn.Module becomes a graph whose segments, run in sequence, are the model.

Every check compares against plain autograd on an identical copy of the model, same input,
same RNG seed, float64: outputs, input and parameter gradients, and BatchNorm buffers must be
bitwise equal, for every admissible cut at once, the articulation cuts, and random subsets.
"""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.frontend.fx_capture import (
    all_cuts,
    articulation_cuts,
    capture,
    cut_problem,
    live_values,
    segments,
)
from edgetrain.models import build, sample_input
from edgetrain.models.mobilenetv2 import MobileNetV2
from edgetrain.models.tiny_lm import TinyLM
from edgetrain.models.unet import UNet
from edgetrain.models.vit import ViT


@pytest.fixture(autouse=True)
def one_thread():
    """Small float64 kernels: one thread is faster than two fighting over a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class UserNet(nn.Module):
    """Written the way users write models: default (not in-place) activations, SiLU and GELU,
    BatchNorm, dropout as a module and as a function, a convolution called twice, a skip, a
    frozen first layer, and an output layer tied to an earlier weight through F.linear."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stem.requires_grad_(False)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.SiLU()
        self.shared = nn.Conv2d(8, 8, 3, padding=1)
        self.drop = nn.Dropout(0.3)
        self.proj = nn.Linear(8, 16)
        self.gelu = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn(self.stem(x)))
        skip = x
        x = torch.relu(self.shared(x))
        x = self.shared(self.drop(x)) + skip
        x = F.dropout(x, 0.2, training=self.training)
        h = self.gelu(self.proj(x.mean((2, 3))))
        return F.linear(h, self.proj.weight.t())


class InplaceViews(nn.Module):
    """In-place updates through views, a transpose, Tanh, and a reduction of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 12)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).view(-1, 3, 4)
        y.mul_(2)
        z = self.act(y.transpose(1, 2))
        z = z.flatten(1)
        z += x.sum(1, keepdim=True)
        return z.relu_()


def small_models():
    """(name, model factory, input factory): every model family at test size."""
    return [
        ("resnet18-module", lambda: build("resnet18-module"), lambda: torch.randn(2, 3, 32, 32)),
        ("resnet50-module", lambda: build("resnet50-module"), lambda: torch.randn(2, 3, 32, 32)),
        ("mobilenetv2", lambda: MobileNetV2(10, width=0.25), lambda: torch.randn(2, 3, 32, 32)),
        ("unet", lambda: UNet(classes=2, base=4, depth=3), lambda: torch.randn(2, 3, 16, 16)),
        (
            "vit",
            lambda: ViT(image_size=16, patch=4, dim=24, depth=2, heads=2, num_classes=5),
            lambda: torch.randn(2, 3, 16, 16),
        ),
        (
            "tinylm",
            lambda: TinyLM(vocab=40, context=16, dim=16, depth=2, heads=2),
            lambda: torch.randint(0, 40, (2, 10)),
        ),
        ("usernet", UserNet, lambda: torch.randn(3, 3, 8, 8)),
        ("inplace-views", InplaceViews, lambda: torch.randn(4, 6)),
    ]


def _double(x: torch.Tensor) -> torch.Tensor:
    return x.double() if x.is_floating_point() else x


def _step(model: nn.Module, x: torch.Tensor, seed: int):
    torch.manual_seed(seed)
    out = model(x)
    out.square().sum().backward()
    return out


def _assert_same_training(original, twin, run_twin, x):
    """One step of ``original`` and of ``run_twin`` (which trains ``twin``, an identical copy)
    on the same input and seed; outputs, gradients and buffers compared bitwise."""
    x1 = x.clone().requires_grad_(x.is_floating_point())
    x2 = x.clone().requires_grad_(x.is_floating_point())
    out1, out2 = _step(original, x1, 7), _step(run_twin, x2, 7)
    assert torch.equal(out1, out2)
    if x.is_floating_point():
        assert torch.equal(x1.grad, x2.grad)
    for (name, p1), (_, p2) in zip(
        original.named_parameters(), twin.named_parameters(), strict=True
    ):
        assert (p1.grad is None) == (p2.grad is None), name
        if p1.grad is not None:
            assert torch.equal(p1.grad, p2.grad), name
    for (name, b1), (_, b2) in zip(original.named_buffers(), twin.named_buffers(), strict=True):
        assert torch.equal(b1, b2), name


def _cut_sets(name, captured, rng):
    cuts = all_cuts(captured)
    if name.startswith("resnet"):  # full width: every cut at once is the hardest case
        return {"every": list(cuts)}
    subset = sorted(rng.sample(cuts, k=min(len(cuts), 5)))
    return {"every": list(cuts), "articulation": list(articulation_cuts(captured)), "some": subset}


@pytest.mark.parametrize(("name", "make", "make_input"), small_models(), ids=lambda v: v)
def test_segments_in_sequence_equal_the_model_bitwise(name, make, make_input):
    torch.manual_seed(0)
    original = make().double().train()
    x = _double(make_input())
    for label, cuts in _cut_sets(
        name, capture(copy.deepcopy(original), x), random.Random(1)
    ).items():
        twin = copy.deepcopy(original)
        sequence = segments(capture(twin, x), cuts)
        assert len(sequence) == len(cuts) + 1, label
        _assert_same_training(original, twin, sequence, x)
        original.zero_grad()


@pytest.mark.parametrize(("name", "make", "make_input"), small_models(), ids=lambda v: v)
def test_each_segment_takes_and_returns_exactly_the_live_values(name, make, make_input):
    torch.manual_seed(0)
    model = make().double()
    x = _double(make_input())
    captured = capture(model, x)
    cuts = list(all_cuts(captured))
    bounds = [0, *cuts, len(captured.nodes)]
    value: object = x
    for k, segment in enumerate(segments(captured, cuts)):
        incoming = live_values(captured, bounds[k])
        outgoing = live_values(captured, bounds[k + 1])
        inputs = value if isinstance(value, tuple) else (value,)
        assert len(inputs) == len(incoming)
        value = segment(value)
        if k == len(cuts):
            break
        outputs = value if isinstance(value, tuple) else (value,)
        assert len(outputs) == len(outgoing)
        for out_name, out in zip(outgoing, outputs, strict=True):
            assert isinstance(out, torch.Tensor)
            node = captured.node(out_name) if out_name not in captured.inputs else None
            if node is not None:
                assert tuple(out.shape) == node.shape and out_name
                assert out.numel() * out.element_size() == node.bytes
            if out_name in incoming:  # passes through: the same object, not a copy
                assert out is inputs[incoming.index(out_name)]


def test_resnet_articulation_cuts_are_between_blocks_and_skips_cross_block_cuts():
    captured = capture(build("resnet18-module"), torch.randn(2, 3, 32, 32))
    articulation = articulation_cuts(captured)
    # One cut after the stem's pooling and one after each of the 8 blocks' final ReLU (the
    # last before the head), plus the head's own chain of single tensors.
    after = {captured.nodes[c - 1].target for c in articulation}
    assert {"maxpool", *(f"layer{g}.{i}.relu" for g in (1, 2, 3, 4) for i in (0, 1))} <= after
    joins = [n for n in captured.nodes if n.target == "_operator.iadd"]
    assert len(joins) == 8  # `out += identity`, kept in place as eager runs it
    assert all(join.mutates == (join.reads[0],) for join in joins)
    # Inside a block, a cut carries the trunk and the skip (the block's input), as a tuple.
    conv2 = next(i for i, n in enumerate(captured.nodes) if n.target == "layer1.0.conv2")
    assert live_values(captured, conv2) == ("maxpool", "layer1_0_relu")
    assert conv2 in all_cuts(captured) and conv2 not in articulation


def test_unet_skips_stay_live_across_the_bottom():
    model = UNet(classes=2, base=4, depth=3)
    captured = capture(model, torch.randn(2, 3, 16, 16))
    bottom = next(i for i, n in enumerate(captured.nodes) if n.target.startswith("bottom"))
    live = live_values(captured, bottom)
    assert len(live) == 4  # the three encoder skips and the pooled map
    assert bottom in all_cuts(captured) and bottom not in articulation_cuts(captured)


def test_inplace_and_view_nodes_are_recorded_and_not_cut_before():
    captured = capture(InplaceViews(), torch.randn(4, 6))
    by_target = {n.target: n for n in captured.nodes}
    lin, view, mul = by_target["lin"], by_target["view"], by_target["mul_"]
    assert view.alias_of == lin.name and not view.inplace
    assert mul.mutates == (view.name,) and mul.alias_of == view.name
    assert by_target["transpose"].alias_of is not None
    positions = {n.name: i for i, n in enumerate(captured.nodes)}
    # Between the linear layer and the in-place multiply of its view, no cut is admissible.
    for cut in range(positions[lin.name] + 1, positions[mul.name] + 1):
        assert cut_problem(captured, cut) is not None
        with pytest.raises(InvalidInput, match=f"cannot cut at {cut}"):
            segments(captured, [cut])


def test_node_records_reads_kinds_and_bytes():
    model = UserNet().double()
    captured = capture(model, torch.randn(3, 3, 8, 8, dtype=torch.float64))
    kinds = {n.kind for n in captured.nodes}
    assert kinds == {"module", "function", "method"}
    shared = [n for n in captured.nodes if n.target == "shared"]
    assert len(shared) == 2  # called twice, two nodes, one module
    linear = next(n for n in captured.nodes if n.target.endswith("linear"))
    assert linear.kind == "function"
    tied = next(n for n in captured.nodes if "proj.weight" in n.attributes)
    assert tied.target == "t"
    stem = captured.nodes[0]
    assert stem.reads == captured.inputs and stem.shape == (3, 8, 8, 8)
    assert stem.bytes == 3 * 8 * 8 * 8 * 8 and stem.dtype == "float64"


def test_capture_leaves_buffers_and_rng_untouched():
    model = UNet(classes=2, base=4, depth=2)
    x = torch.randn(2, 3, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    capture(model, x)
    assert torch.equal(torch.rand(3), expected)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y
        return -y


class LoopsOverRows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([row * 2 for row in x])


def test_untraceable_models_are_one_line_naming_the_construct_and_the_fix():
    with pytest.raises(InvalidInput) as info:
        capture(DataDependent(), torch.randn(2, 4))
    message = str(info.value)
    assert "\n" not in message
    assert "if/while on a tensor's value" in message and "if y.sum() > 0" in message
    assert "torch.where" in message
    with pytest.raises(InvalidInput, match="a loop over a tensor") as info:
        capture(LoopsOverRows(), torch.randn(2, 4))
    assert "[row * 2 for row in x]" in str(info.value)


class WithOptionalArguments(nn.Module):
    """forward(x, mask=None, scale=2.0), the usual signature of attention-style code."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask=None, scale: float = 2.0) -> torch.Tensor:
        y = self.lin(x)
        if mask is not None:
            y = y * mask
        return torch.tanh(y * scale)


def test_optional_arguments_are_fixed_to_their_defaults():
    torch.manual_seed(0)
    original = WithOptionalArguments().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    twin = copy.deepcopy(original)
    captured = capture(twin, x)
    assert captured.inputs == ("x",)
    assert [n.target for n in captured.nodes] == ["lin", "_operator.mul", "torch.tanh"]
    _assert_same_training(original, twin, segments(captured, all_cuts(captured)), x)


def test_wrong_sample_and_bad_cuts_are_one_line():
    with pytest.raises(InvalidInput, match="does not run on the sample"):
        capture(nn.Linear(4, 2), torch.randn(2, 5))
    with pytest.raises(InvalidInput, match="takes 1 inputs but the sample has 2"):
        capture(nn.Linear(4, 2), (torch.randn(2, 4), torch.randn(2, 4)))
    captured = capture(
        nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(2, 4)
    )
    with pytest.raises(InvalidInput, match="cuts must increase"):
        segments(captured, [2, 1])
    with pytest.raises(InvalidInput, match="not between two nodes"):
        segments(captured, [3])


@pytest.mark.parametrize("name", ["mobilenetv2", "unet", "vit-tiny", "tinylm", "resnet50-module"])
def test_registered_models_capture_at_full_width(name):
    size = 8 if name == "tinylm" else 32
    model = build(name, image=size)
    captured = capture(model, sample_input(name, 2, size))
    assert articulation_cuts(captured)
    assert all(n.is_tensor for n in captured.nodes if n.kind == "module")


@pytest.mark.parametrize(("name", "make", "make_input"), small_models(), ids=lambda v: v)
def test_live_values_match_the_definition_on_the_fx_graph(name, make, make_input):
    torch.manual_seed(0)
    captured = capture(make(), make_input())
    graph = captured.graph_module.graph
    order = [n for n in graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    position = {n: i for i, n in enumerate(order)}
    values = [n for n in graph.nodes if n.op == "placeholder"] + order
    for cut in range(1, len(order)):
        expected = tuple(
            v.name
            for v in values
            if position.get(v, -1) < cut
            and any(u.op == "output" or position.get(u, -1) >= cut for u in v.users)
        )
        assert live_values(captured, cut) == expected, cut


class IgnoresItsSecondInput(nn.Module):
    def forward(self, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * 2)


def test_an_unused_input_is_not_live_after_the_start():
    captured = capture(IgnoresItsSecondInput(), (torch.randn(2), torch.randn(3)))
    assert live_values(captured, 0) == ("x", "unused")
    assert live_values(captured, 1) == ("mul",)
    net = segments(captured, [1])
    x = torch.randn(2)
    assert torch.equal(net((x, torch.randn(3))), torch.tanh(x * 2))
