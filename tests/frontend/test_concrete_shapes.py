"""Capture at the sample's shapes: shape logic is taken once, shapes never block a cut.

Each model here branches, slices or reshapes on its input's shape, the way models are
written; the captured segments, run in sequence, must train exactly as the model (float64,
bitwise outputs and gradients, same RNG), and what depends on a tensor's value stays refused.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.frontend.fx_capture import all_cuts, articulation_cuts, capture, segments
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.runtime.checkpointed import Checkpointed

F64 = torch.float64


class Attention(nn.Module):
    """nanoGPT's causal self-attention: the shapes read again in every layer."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("bias", torch.ones(64, 64, dtype=torch.bool).tril().view(1, 1, 64, 64))

    def forward(self, x: torch.Tensor, B: int, T: int, C: int) -> torch.Tensor:
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        att = att.masked_fill(~self.bias[:, :, :T, :T], float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, B: int, T: int, C: int) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), B, T, C)
        h = self.out(F.gelu(self.fc(self.ln2(x))))
        return x + h.view(B, T, C)


class NanoGPT(nn.Module):
    """``B, T = idx.shape`` and ``B, T, C`` passed to every layer, as nanoGPT-style models do."""

    def __init__(self, layers: int = 4, width: int = 32, heads: int = 4, vocab: int = 50) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        C = x.size(-1)
        for block in self.blocks:
            x = block(x, B, T, C)
        return self.head(self.ln(x))


class Padded(nn.Module):
    """A padding helper (``if H % 2 or W % 2``) and a branch on a resized shape, as timm's
    MobileViT writes them; ``len(x)`` and ``x.numel()`` as numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H, W = x.shape[-2:]
        if H % 2 or W % 2:
            x = F.pad(x, (0, W % 2, 0, H % 2))
        y = torch.relu(self.norm(self.conv(x)))
        new_h, new_w = y.shape[2] * 2, y.shape[3] * 2
        if new_h != H or new_w != W:
            y = F.interpolate(y, size=(new_h, new_w), mode="bilinear", align_corners=False)
        noise = torch.rand(len(y), 1, 1, 1, dtype=y.dtype)  # a fresh draw at every step
        return y * noise / (y.numel() // y.dim())


class Gate(nn.Module):
    """Branches on a tensor's value: cannot be traced, runs as one call when kept a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return torch.tanh(y)
        return -y


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.gate, self.b = nn.Linear(8, 8), Gate(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.gate(torch.relu(self.a(x)))))


def _step(model, x, seed):
    torch.manual_seed(seed)
    out = model(x)
    out.pow(2).mean().backward()
    return out


def _same_training(model, run, twin, x):
    out1, out2 = _step(model, x, 3), _step(run, x, 3)
    assert torch.equal(out1, out2)
    for (name, p1), p2 in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p1.grad, p2.grad), name
    for b1, b2 in zip(model.buffers(), twin.buffers(), strict=True):
        assert torch.equal(b1, b2)


@pytest.mark.parametrize(
    ("make", "x"),
    [
        (NanoGPT, torch.randint(0, 50, (2, 16))),
        (Padded, torch.randn(2, 3, 9, 12, dtype=F64)),
    ],
    ids=["nanogpt", "padded"],
)
def test_shape_logic_is_taken_once_and_the_segments_train_exactly(make, x):
    torch.manual_seed(0)
    model = make().double().train()
    twin = copy.deepcopy(model)
    captured = capture(twin, x)
    # no shape value is a node: only tensors, and the tuple a split makes
    assert {n.target for n in captured.nodes if not n.is_tensor} <= {"split"}
    _same_training(model, segments(captured, all_cuts(captured)), twin, x)


def test_a_random_draw_without_traced_arguments_is_drawn_at_every_step():
    torch.manual_seed(0)
    captured = capture(Padded().double(), torch.randn(2, 3, 8, 8, dtype=F64))
    assert "torch.rand" in [n.target for n in captured.nodes]
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    with torch.no_grad():
        assert not torch.equal(captured.graph_module(x), captured.graph_module(x))


def drop_rows(x: torch.Tensor, p: float) -> torch.Tensor:
    """Stochastic depth as torchvision writes it: a function fx keeps whole (``torch.fx.wrap``)
    that draws its own noise on the input's device."""
    noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device)
    return x * noise.bernoulli_(1 - p).div_(1 - p)


torch.fx.wrap("drop_rows")


class RowDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.a(x))
        return self.b(drop_rows(y, 0.5) + y)


def test_a_wrapped_function_drawing_its_own_noise_is_one_node_drawn_at_every_step():
    torch.manual_seed(0)
    model = RowDrop().double().train()
    twin = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=F64)
    captured = capture(twin, x)
    assert [str(n.target).endswith("drop_rows") for n in captured.nodes].count(True) == 1
    assert not any("bernoulli" in str(n.target) for n in captured.nodes)
    _same_training(model, segments(captured, all_cuts(captured)), twin, x)


def test_shapes_read_once_do_not_block_the_cuts_between_layers():
    """``B, T, C`` are ints baked into the graph: the model is cut between every pair of
    layers (one tensor crosses), and the first layer is no larger than the others."""
    layers = 4
    captured = capture(NanoGPT(layers=layers), torch.randint(0, 50, (2, 16)))
    between = articulation_cuts(captured)
    assert len(between) >= layers
    first = min(c for c in all_cuts(captured))
    assert first <= len(captured.nodes) // (2 * layers)


def test_a_value_branch_is_refused_naming_the_module_to_keep_whole_and_runs_as_a_leaf():
    x = torch.randn(4, 8, dtype=F64)
    with pytest.raises(InvalidInput) as info:
        capture(Gated().double(), x)
    message = str(info.value)
    assert "if y.sum() > 0" in message and "leaf_modules=(Gate,)" in message
    assert "\n" not in message
    torch.manual_seed(0)
    model = Gated().double()
    twin = copy.deepcopy(model)
    captured = capture(twin, x, leaf_modules=(Gate,))
    assert "gate" in [n.target for n in captured.nodes]
    _same_training(model, segments(captured, all_cuts(captured)), twin, x)


def test_checkpointed_takes_leaf_modules_and_refuses_what_is_not_a_module_class():
    torch.manual_seed(0)
    model = Gated().double()
    twin = copy.deepcopy(model)
    x = torch.randn(64, 8, dtype=F64)
    net = Checkpointed(twin, x, memory_budget="min", leaf_modules=(Gate,))
    _same_training(model, net, twin, x)
    with pytest.raises(InvalidInput, match="leaf_modules takes nn"):
        capture(Gated(), x.float(), leaf_modules=("Gate",))


class MaskedLinear(nn.Module):
    """Makes a boolean of an integer mask where the input is, as transformers makes its masks
    (``mask.to(device=x.device, dtype=torch.bool)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = mask.to(device=x.device, dtype=torch.bool)
        return self.lin(x).masked_fill(~keep[..., None], 0.0)


def test_a_move_to_where_the_tensor_is_holds_no_device_and_sizes_on_meta():
    model = MaskedLinear().to(F64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    inputs = {"x": torch.randn(2, 5, 8, dtype=F64), "mask": mask}
    graph = capture(model, inputs).graph_module.graph
    moves = [n for n in graph.nodes if n.target == "to"]
    assert moves and all("device" not in n.kwargs for n in moves)
    chain = analytic_chain(model, inputs)  # on meta tensors: a CPU device in the graph fails
    plain = copy.deepcopy(model)
    net = Checkpointed(model, inputs, chain=chain, memory_budget="min")
    net(**inputs).sum().backward()
    plain(**inputs).sum().backward()
    assert torch.equal(model.lin.weight.grad, plain.lin.weight.grad)
