"""Fine-tuning a frozen base: the smallest device memory for full training against training
only a head, the last block or LoRA adapters, on BERT-base and ResNet-50.

Each model is built from its config (no weights) and sized on meta tensors
(:func:`edgetrain.analytic_chain`: what autograd saves, per stage, from shapes alone), once per
way of training it; the planner's frontier (:func:`edgetrain.frontier`) gives the smallest
activation memory of any plan and the least within a recompute factor of 1.15. The device
memory is the fixed part (:func:`edgetrain.core.accounting.fixed_training_bytes`: weights,
gradients and Adam's two states for the trainable parameters only, buffers, the input; the
loop that keeps gradients, as ``edgetrain plan`` plans) plus that activation peak. One
device per model, a tenth above the largest fine-tune's smallest memory, is then asked of
every way of training it: full training is refused (``InfeasibleBudget``), the fine-tunes
plan.

BERT-base: ``transformers``' ``BertForSequenceClassification(BertConfig())`` when it can be
captured; otherwise this repository's pre-norm transformer encoder
(:mod:`edgetrain.models.transformer`) at BERT-base's sizes (vocabulary 30522, 512 positions,
12 layers, width 768, 12 heads, MLP 3072, a pooler and a 2-class classifier), which the
``model`` field says. LoRA: rank 8 on the attention's projections (the query/key/value
projection and the output projection), the classifier trained too.

``--measure`` also runs small twins (ResNet-50 at batch 2, 64²; the encoder at width 64, 2
layers, 32 tokens) with ``Checkpointed`` at their smallest budget in each way: measured step
peak against the prediction. Every other figure is from the planner and the sizes on meta.

    python benchmarks/frozen.py [--batch 8] [--tokens 128] [--image 224] [--measure] [--json]
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit

import edgetrain
from edgetrain.core.accounting import fixed_training_bytes
from edgetrain.errors import InvalidInput
from edgetrain.models import thirdparty
from edgetrain.models.transformer import Block
from edgetrain.planners.search import plan_for_device

RHO = 1.15
MiB = 2**20


class LoRA(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``x A^T B^T`` (B starts at 0)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class Encoder(nn.Module):
    """A BERT-shaped classifier from this repository's blocks: token, position and segment
    embeddings, LayerNorm, ``depth`` pre-norm blocks, a tanh pooler on the first token, and a
    linear classifier."""

    def __init__(self, vocab=30522, positions=512, dim=768, depth=12, heads=12, classes=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(positions, dim))  # BERT's: an embedding
        self.segment = nn.Embedding(2, dim)
        self.norm = nn.LayerNorm(dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.pooler = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.size(1)] + self.segment.weight[0]
        x = self.blocks(self.norm(x))
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def _wrap_lora(model: nn.Module, suffixes: tuple[str, ...], rank: int) -> None:
    for name, module in list(model.named_modules()):
        for child, sub in list(module.named_children()):
            full = f"{name}.{child}" if name else child
            if isinstance(sub, nn.Linear) and full.endswith(suffixes):
                setattr(module, child, LoRA(sub, rank))


def _trained_as(model: nn.Module, way: str, spec: dict[str, Any]) -> nn.Module:
    """A copy of ``model`` trained ``way``: full, head, last block, or LoRA adapters."""
    model = copy.deepcopy(model)
    if way == "full":
        return model
    model.requires_grad_(False)
    for name in spec["head"] + (spec["last"] if way == "last block + head" else ()):
        model.get_submodule(name).requires_grad_(True)
    if way == "LoRA + head":
        _wrap_lora(model, spec["lora"], rank=8)
    return model


def _bert(
    batch: int, tokens: int, small: bool, captured: bool | None = None
) -> tuple[nn.Module, Any, dict[str, Any]]:
    """BERT-base (or its small twin): transformers' model when ``captured`` (None: when the
    capture takes it), else this repository's encoder at the same sizes."""
    sizes = dict(dim=64, depth=2, heads=2, vocab=1000) if small else {}
    transformers = thirdparty.transformers()
    x = torch.zeros(batch, tokens, dtype=torch.long)
    config = transformers.BertConfig(
        **(
            dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=1000)
            if small
            else {}
        )
    )
    hf = transformers.BertForSequenceClassification(config)
    why = "not captured for the full-size model"
    try:
        if captured is False:
            raise InvalidInput(why)
        if captured is None:
            edgetrain.analytic_chain(hf, x, timing=False)
        spec = {"model": "transformers BertForSequenceClassification(BertConfig())", "hf": True}
        last = f"bert.encoder.layer.{config.num_hidden_layers - 1}"
        spec |= {"head": ("bert.pooler", "classifier"), "last": (last,)}
        spec["lora"] = ("attention.self.query", "attention.self.key", "attention.self.value")
        spec["lora"] += ("attention.output.dense",)
        return hf, x, spec
    except InvalidInput as exc:
        why = str(exc).split(": ", 1)[-1].split(" at ")[0][:80]
    encoder = Encoder(**sizes)  # type: ignore[arg-type]
    spec = {
        "model": f"edgetrain transformer at BERT-base sizes (transformers' BERT: {why})",
        "head": ("pooler", "classifier"),
        "last": (f"blocks.{len(encoder.blocks) - 1}",),
        "lora": ("attn.qkv", "attn.proj"),
        "hf": False,
    }
    return encoder, x, spec


def _resnet50(
    batch: int, image: int, small: bool, captured: bool | None = None
) -> tuple[nn.Module, Any, dict[str, Any]]:
    model = thirdparty.torchvision().models.resnet50()
    spec = {"model": "torchvision resnet50()", "head": ("fc",), "last": ("layer4",), "lora": ()}
    return model, torch.randn(batch, 3, image, image), spec


WAYS = {
    "BERT-base": ("full", "head", "last block + head", "LoRA + head"),
    "ResNet-50": ("full", "head", "last block + head"),
}


def _row(name: str, way: str, model: nn.Module, x: Any, spec: dict[str, Any]) -> dict[str, Any]:
    chain = edgetrain.analytic_chain(model, x)
    fixed = fixed_training_bytes(chain, "adam")
    points = edgetrain.frontier(chain, grads_exist=True)
    within = [p for p in points if p.recompute_factor <= RHO + 1e-9]
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {
        "model": name,
        "trains": way,
        "stages": chain.length,
        "trained_MiB": trained / MiB,
        "fixed_MiB": fixed / MiB,
        "plain_activations_MiB": points[-1].activation_bytes / MiB,
        "least_activations_MiB": points[0].activation_bytes / MiB,
        "least_rho": points[0].recompute_factor,
        "smallest_device_MiB": (fixed + points[0].activation_bytes) / MiB,
        f"device_at_rho_{RHO}_MiB": (fixed + within[0].activation_bytes) / MiB,
        "_chain": chain,
        "_fixed": fixed,
        "_smallest": fixed + points[0].activation_bytes,
        "_spec": spec["model"],
    }


def _device_check(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One device for the model: a tenth above the largest fine-tune's smallest memory, below
    full training's. Each way of training asked to plan on it: planned (the step's predicted
    memory and recompute factor) or refused."""
    device = int(1.1 * max(r["_smallest"] for r in rows if r["trains"] != "full"))
    result = []
    for row in rows:
        entry = {"model": row["model"], "device_MiB": device / MiB, "trains": row["trains"]}
        try:
            schedule = plan_for_device(
                row["_chain"], "optimal", device_bytes=device, fixed_bytes=row["_fixed"],
                grads_exist=True,
            )  # fmt: skip
        except edgetrain.InfeasibleBudget as exc:
            entry["result"] = f"refused: {exc}"
        else:
            cost = edgetrain.simulate(row["_chain"], schedule, grads_exist=True)
            step = (row["_fixed"] + cost.peak_bytes) / MiB
            entry["result"] = (
                f"planned: {step:.1f} MiB, recompute factor {cost.recompute_factor:.3f}"
            )
        result.append(entry)
    return result


def _measured(
    name: str, make: Callable[..., tuple[nn.Module, Any, dict[str, Any]]], full: dict[str, Any]
) -> list:
    """Small twins run with Checkpointed at their smallest budget: measured peak vs predicted.
    A twin is the same kind of model as the full-size one (``full``: its spec)."""
    small = (2, 64) if name == "ResNet-50" else (2, 32)
    base, x, spec = make(*small, small=True, captured=full.get("hf"))
    rows = []
    for way in WAYS[name]:
        model = _trained_as(base, way, spec)
        net = edgetrain.Checkpointed(model, x, memory_budget="min")
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(params)
        for _ in range(2):  # the second step: Adam's state exists, gradients set to None
            optimizer.zero_grad()
            counter = edgetrain.StorageCounter()
            with counter:
                out = net(x)
                out = getattr(out, "logits", out)  # a Hugging Face model's output holds them
                out.float().square().mean().backward()
            optimizer.step()
        measured = counter.peak_bytes
        rows.append({
            "model": f"{name} (small twin)", "trains": way,
            "predicted_KiB": net.cost.peak_bytes / 1024, "measured_KiB": measured / 1024,
            "measured/predicted": measured / net.cost.peak_bytes,
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--models", default="BERT-base,ResNet-50")
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    makers: dict[str, Callable[..., tuple[nn.Module, Any, dict[str, Any]]]] = {
        "BERT-base": _bert,
        "ResNet-50": _resnet50,
    }
    rows, devices, measured = [], [], []
    for name in args.models.split(","):
        shape = (args.batch, args.tokens if name == "BERT-base" else args.image)
        with torch.device("meta"):
            base, x, spec = makers[name](*shape, small=False)
        x = torch.empty_like(x, device="meta")
        mine = [_row(name, way, _trained_as(base, way, spec), x, spec) for way in WAYS[name]]
        devices += _device_check(mine)
        rows += mine
        if args.measure:
            measured += _measured(name, makers[name], spec)
    models = {r["model"]: r["_spec"] for r in rows}
    shown = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    title = (
        f"Frozen bases: smallest device memory (Adam, gradients kept), batch {args.batch}, "
        f"{args.tokens} tokens, {args.image}x{args.image}"
    )
    extra = {"models": models, "device_budgets": devices, "measured": measured}
    emit(title, list(shown[0]), shown, args.json, extra)


if __name__ == "__main__":
    main()
