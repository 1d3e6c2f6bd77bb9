"""The memory promise on attention the way users write it: ``nn.MultiheadAttention`` with
``batch_first=True`` in a pre-norm block, and ``F.scaled_dot_product_attention`` called
directly. Two things the prediction must follow here:

* On meta tensors attention takes its math path (it saves the ``L × L`` weights), on the CPU
  its flash kernel: a plain-autograd step sized on meta's own path reads 18 % above the real one.
* The block's residual addition hands one gradient storage to the trunk and to the attention's
  output, so the attention's backward cannot free it early: a profile that gave the two outputs
  gradients of their own would leave the tightest plan, in the loop that keeps gradients, 520
  bytes (8 KiB at the stage's backward) above its prediction and its budget.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.core.simulator import simulate
from edgetrain.frontend.cuts import as_stages
from edgetrain.frontend.profiling import analytic_chain, profile_chain
from edgetrain.planners.optimal import minimum_memory, store_all
from edgetrain.runtime.checkpointed import Checkpointed
from tests.helpers import step_peak

# The caller's loss (a sum of squares of a 4 × 10 output) is not part of the model's step: at
# most its scalar and the squares' 160 bytes come on top of the prediction.
LOSS_BYTES = 168


class Block(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class SdpaBlock(nn.Module):
    """Attention written out with ``F.scaled_dot_product_attention`` and a boolean causal mask
    (a buffer, as GPT-style code keeps it)."""

    def __init__(self, width: int = 32, heads: int = 4, tokens: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.register_buffer("keep", torch.ones(tokens, tokens, dtype=torch.bool).tril())
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.keep
        )
        return x + torch.tanh(self.proj(out.transpose(1, 2).reshape(b, n, d)))


class Net(nn.Module):
    def __init__(self, block: type[nn.Module], blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[block() for _ in range(blocks)])
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(1))


def model(block: type[nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Net(block), torch.randn(4, 16, 32)


@pytest.mark.parametrize("block", [Block, SdpaBlock])
def test_plain_autograds_step_sized_on_meta_tensors_is_the_cpus(block):
    net, x = model(block)
    chain = analytic_chain(net, x)
    params = list(net.parameters())
    for kept, predicted in zip((False, True), chain.autograd_peak_bytes, strict=True):
        measured = step_peak(net, x, kept=kept, params=params)
        assert predicted - LOSS_BYTES <= measured <= predicted + LOSS_BYTES, kept


@pytest.mark.parametrize("block", [Block, SdpaBlock])
def test_attention_models_chain_from_shapes_has_the_measured_byte_counts(block):
    net, x = model(block)
    stages = as_stages(net, x)
    assert analytic_chain(net, x).fingerprint() == profile_chain(stages, x, repeats=1).fingerprint()


@pytest.mark.parametrize("block", [Block, SdpaBlock])
@pytest.mark.parametrize("kept", [False, True])
def test_attention_plans_hold_their_budget_in_both_loops(block, kept):
    net, x = model(block)
    chain = Checkpointed(copy.deepcopy(net), x).chain
    least = minimum_memory(chain, grads_exist=kept)
    everything = simulate(chain, store_all(chain), grads_exist=kept).peak_bytes
    assert least < everything
    for budget in (least, (least + everything) / 2, everything):
        ours = copy.deepcopy(net)
        schedule = edgetrain.plan(chain, "optimal", memory=budget, grads_exist=kept)
        run = Checkpointed(ours, x, chain=chain, schedule=schedule)
        measured = step_peak(run, x, kept=kept, params=list(ours.parameters()))
        predicted = run.cost.peak_bytes
        assert predicted <= budget + 1
        assert predicted * 0.98 <= measured <= predicted + LOSS_BYTES, (budget, run.runs_as)
