"""Model zoo benchmark: torchvision, timm and Hugging Face models trained by ``Checkpointed``,
beside ``torch.utils.checkpoint`` and selective activation checkpointing at the same memory.

For each model of :data:`edgetrain.models.zoo.ZOO` (built from its config, float32, one torch
thread), one training step in the loop that keeps gradients between steps (``zero_grad()``
zeroing them in place, so the step's peak is what activations and the gradients in flight
take: its *activation peak*). The step's loss is the model's own (a Hugging Face model given
``labels``) or, for a model that returns a tensor, a gradient handed to its output (so that
every configuration's peak is the model's, not the caller's loss's). Configurations:

* ``plain``: eager autograd, the reference of every ratio.
* ``edgetrain ρ≤1.15``: ``Checkpointed(model, x, max_recompute=1.15)``, made from nothing (its
  construction, capture, profile and plan, is ``construct_s``); ``edgetrain min``:
  ``memory_budget="min"`` on the same profiled chain.
* ``checkpoint``: ``torch.utils.checkpoint.checkpoint(block, use_reentrant=False)`` around each
  block (``ZooModel.blocks``: residual blocks, transformer layers); ``SAC``: the same blocks under
  selective activation checkpointing (``create_selective_checkpoint_contexts``) saving the outputs
  of convolutions, matrix products and attention and recomputing the rest (:data:`SAVED`).
* ``edgetrain ≤ checkpoint`` / ``edgetrain ≤ SAC``: ``Checkpointed`` on the same chain with
  ``memory_budget`` = what the step starts with + the heap ``checkpoint`` / ``SAC`` took from the
  device (tensors and kernel scratch: the larger of torch's allocator record and glibc's
  ``mallinfo2``; the budget counts both, so this is the same memory); a budget refused is a
  note in the row.

Memory: ``StorageCounter`` (live tensor storages, exact) over one step after a warm-up;
``mem/plain`` is a configuration's activation peak over plain's. ``pred/meas`` is edgetrain's
predicted peak over its measured one. Time: process CPU time in interleaved rounds (each round
in a shuffled order), paired: ``cpu/plain`` is the median over rounds of the step over plain's
step of the same round. ``rho_pred`` is the plan's predicted recompute factor (its stages'
profiled compute over plain's); ``overhead`` = ``cpu/plain`` - ``rho_pred``: what the executor
costs beyond the compute the planner counts. ``vs ckpt`` / ``vs SAC``: edgetrain's step at that
memory over the torch configuration's step, paired.

    python benchmarks/zoo.py [--models tv-resnet,hf-bert] [--rounds 5] [--json]
    python benchmarks/zoo.py --quick        # three models, tiny inputs, three rounds
    python benchmarks/zoo.py --base --rounds 3   # BERT-base, GPT-2 small, ResNet-50, ViT-B/16
    python benchmarks/zoo.py --out benchmarks/data/zoo.json   # the stored result
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    emit,
    interleaved_samples,
    measured_on,
    paired_ratio,
    sample_medians,
    step_heap_bytes,
    step_peak_bytes,
)

from edgetrain.errors import EdgetrainError
from edgetrain.models.zoo import ZOO, ZooModel, call
from edgetrain.runtime.checkpointed import Checkpointed

MiB = 2**20
SIZES = {"full": (8, 64, 128), "quick": (2, 32, 16), "base": (2, 128, 128)}
"""Batch, image side, tokens."""
QUICK_MODELS = ("tv-resnet", "timm-vit", "hf-bert")


def _bert_base(size: int) -> nn.Module:
    from edgetrain.models import thirdparty

    tr = thirdparty.transformers()
    config = tr.BertConfig(num_labels=3, attn_implementation="eager")
    return tr.BertForSequenceClassification(config)


def _gpt2_small(size: int) -> nn.Module:
    from edgetrain.models import thirdparty

    tr = thirdparty.transformers()
    return tr.GPT2LMHeadModel(tr.GPT2Config(attn_implementation="eager", use_cache=False))


def _torchvision(name: str, **kwargs: Any) -> Callable[[int], nn.Module]:
    def make(size: int) -> nn.Module:
        from edgetrain.models import thirdparty

        return getattr(thirdparty.torchvision().models, name)(num_classes=10, **kwargs)

    return make


BASE: dict[str, ZooModel] = {
    model.name: model
    for model in (
        ZooModel("hf-bert-base", "transformers", "BertForSequenceClassification, BERT-base",
                 _bert_base, ZOO["hf-bert"].inputs, ("BertLayer",), ZOO["hf-bert"].input_names),
        ZooModel("hf-gpt2-small", "transformers", "GPT2LMHeadModel, GPT-2 small", _gpt2_small,
                 ZOO["hf-gpt2"].inputs, ("GPT2Block",), ZOO["hf-gpt2"].input_names),
        ZooModel("tv-resnet50", "torchvision", "resnet50", _torchvision("resnet50"),
                 ZOO["tv-resnet"].inputs, ("Bottleneck",)),
        ZooModel("tv-vit-b-16", "torchvision", "vit_b_16 at 128 px",
                 _torchvision("vit_b_16", image_size=128), ZOO["tv-resnet"].inputs,
                 ("EncoderBlock",)),
    )
}  # fmt: skip
"""Models at the sizes people train (``--base``: batch 2, 128 px, 128 tokens), where the
executor's cost per stage is small beside the compute."""
SAVED = (
    torch.ops.aten.convolution.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)
"""What ``SAC`` saves inside a block; everything else is recomputed in the backward."""


class _Checkpoint(nn.Module):
    """A block run under non-reentrant ``torch.utils.checkpoint`` (selective with ``SAC``)."""

    def __init__(self, block: nn.Module, selective: bool) -> None:
        super().__init__()
        self.block, self.selective = block, selective

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.selective:
            return checkpoint(self.block, *args, use_reentrant=False, context_fn=_policy, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _policy() -> Any:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_blocks(model: nn.Module, blocks: tuple[str, ...], selective: bool) -> nn.Module:
    """``model`` with every block (a module whose class is named in ``blocks``, outermost
    only) under ``torch.utils.checkpoint``."""

    def wrap(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if type(child).__name__ in blocks:
                setattr(parent, name, _Checkpoint(child, selective))
            else:
                wrap(child)

    wrap(model)
    return model


def _backward(out: Any) -> None:
    if isinstance(out, torch.Tensor):
        out.backward(torch.full_like(out, 1 / out.numel()))
    else:
        out.loss.backward()


def _step(net: nn.Module, params: list[nn.Parameter], x: Any) -> Callable[[], None]:
    def step() -> None:
        _backward(call(net, x))
        for p in params:
            if p.grad is not None:
                p.grad.zero_()

    return step


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def bench_model(entry: ZooModel, batch: int, size: int, rounds: int) -> dict[str, Any]:
    """One model's row: every configuration's activation peak and paired step time."""
    torch.manual_seed(0)
    base = entry.make(size)
    x = entry.inputs(batch, size)
    copies: dict[str, nn.Module] = {"plain": copy.deepcopy(base)}
    copies["checkpoint"] = checkpoint_blocks(copy.deepcopy(base), entry.blocks, False)
    copies["SAC"] = checkpoint_blocks(copy.deepcopy(base), entry.blocks, True)
    steps: dict[str, Callable[[], None]] = {}
    peaks: dict[str, int] = {}
    heaps: dict[str, int] = {}
    notes: list[str] = []
    for config, model in copies.items():
        steps[config] = _step(model, list(model.parameters()), x)
        try:
            steps[config]()  # the warm-up step creates the gradients the loop keeps
        except RuntimeError as exc:  # SAC refuses a saved output a later op changes in place
            notes.append(f"{config}: {str(exc).splitlines()[0]}")
            del steps[config]
            continue
        peaks[config] = step_peak_bytes(steps[config])
        heaps[config] = step_heap_bytes(steps[config])
    nets: dict[str, Checkpointed] = {}

    def add(config: str, **kwargs: Any) -> None:
        model = copy.deepcopy(copies["plain"])  # its gradients exist: the loop keeps them
        try:
            net = Checkpointed(model, x, **kwargs)
            step = _step(net, list(model.parameters()), x)
            step()  # may plan again for the loop it finds (gradients kept): refused there too
            peaks[config] = step_peak_bytes(step)
        except EdgetrainError as exc:
            notes.append(f"{config}: {exc}")
            return
        nets[config] = net
        steps[config] = step

    _progress(f"{entry.name}: Checkpointed(max_recompute=1.15) from nothing")
    start = time.perf_counter()
    add("edgetrain ρ≤1.15", max_recompute=1.15)
    construct_s = time.perf_counter() - start
    if "edgetrain ρ≤1.15" not in nets:
        return {"model": entry.name, "note": "; ".join(notes)}
    chain = nets["edgetrain ρ≤1.15"].chain
    fixed = nets["edgetrain ρ≤1.15"].fixed_bytes
    _progress(f"{entry.name}: min, and at checkpoint's and SAC's memory")
    add("edgetrain min", chain=chain, memory_budget="min")
    for torch_config in [c for c in ("checkpoint", "SAC") if c in heaps]:
        add(f"edgetrain ≤ {torch_config}", chain=chain, memory_budget=fixed + heaps[torch_config])
    _progress(f"{entry.name}: {rounds} timing rounds of {len(steps)} steps")
    samples = interleaved_samples(steps, rounds=rounds)
    return _row(entry, batch, size, construct_s, chain.length, peaks, nets, samples, notes)


def _row(
    entry: ZooModel,
    batch: int,
    size: int,
    construct_s: float,
    stages: int,
    peaks: dict[str, int],
    nets: dict[str, Checkpointed],
    samples: dict[str, list[tuple[float, float]]],
    notes: list[str],
) -> dict[str, Any]:
    def cpu(config: str, reference: str = "plain") -> float | None:
        if config not in samples or reference not in samples:
            return None
        return paired_ratio(samples, config, reference)[0]

    def mem(config: str) -> float | None:
        return peaks[config] / peaks["plain"] if config in peaks else None

    row: dict[str, Any] = {
        "model": entry.name,
        "input": f"b{batch} {size} {'tokens' if entry.takes_tokens else 'px'}",
        "stages": stages,
        "plain_MiB": peaks["plain"] / MiB,
        "plain_cpu_s": sample_medians(samples["plain"])[0],
        "construct_s": construct_s,
    }
    for key, config in (("1.15", "edgetrain ρ≤1.15"), ("min", "edgetrain min")):
        net = nets.get(config)
        measured = cpu(config)
        rho = net.cost.recompute_factor if net is not None else None
        row[f"mem/plain@{key}"] = mem(config)
        row[f"cpu/plain@{key}"] = measured
        row[f"rho_pred@{key}"] = rho
        row[f"overhead@{key}"] = None if None in (measured, rho) else measured - rho
        row[f"pred/meas@{key}"] = (
            net.cost.peak_bytes / peaks[config] if net is not None and peaks[config] else None
        )
        row[f"runs_as@{key}"] = net.runs_as if net is not None else None
    for torch_config, short in (("checkpoint", "ckpt"), ("SAC", "SAC")):
        mine = f"edgetrain ≤ {torch_config}"
        row[f"{short} mem/plain"] = mem(torch_config)
        row[f"{short} cpu/plain"] = cpu(torch_config)
        row[f"edgetrain≤{short} mem/plain"] = mem(mine)
        row[f"edgetrain≤{short} cpu/plain"] = cpu(mine)
        row[f"edgetrain/{short} cpu"] = cpu(mine, torch_config)
    row["note"] = "; ".join(notes) or None
    return row


COLUMNS = [
    "model", "input", "stages", "plain_MiB", "plain_cpu_s", "construct_s", "mem/plain@1.15",
    "cpu/plain@1.15", "rho_pred@1.15", "overhead@1.15", "mem/plain@min", "cpu/plain@min",
    "rho_pred@min", "overhead@min", "pred/meas@min",
]  # fmt: skip
TORCH_COLUMNS = [
    "model", "ckpt mem/plain", "ckpt cpu/plain", "edgetrain≤ckpt mem/plain",
    "edgetrain/ckpt cpu", "SAC mem/plain", "SAC cpu/plain", "edgetrain≤SAC mem/plain",
    "edgetrain/SAC cpu", "note",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated, of: {', '.join(ZOO)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="three models, tiny inputs")
    parser.add_argument(
        "--base", action="store_true", help=f"models at their usual sizes: {', '.join(BASE)}"
    )
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (5; quick: 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="also write the JSON result to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    zoo = BASE if args.base else ZOO
    names = args.models.split(",") if args.models else list(QUICK_MODELS if args.quick else zoo)
    unknown = [n for n in names if n not in zoo]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}; choose from {', '.join(zoo)}")
    batch, image, tokens = SIZES["base" if args.base else "quick" if args.quick else "full"]
    rounds = args.rounds or (3 if args.quick else 5)
    rows: list[dict[str, Any]] = []
    extra = {
        "memory": "StorageCounter: activation peak of a step, gradients kept between steps",
        "time": "paired: median over rounds of a step's process CPU time over plain's step of "
        "the same round (rounds shuffled)",
        "measured_on": measured_on(rounds=rounds),
    }
    title = "Model zoo: activation peak and step time, edgetrain against plain autograd"
    title += f" (usual sizes, batch {batch})" if args.base else ""
    for name in names:
        entry = zoo[name]
        rows.append(bench_model(entry, batch, tokens if entry.takes_tokens else image, rounds))
        if args.out:  # after each model: a long run keeps what it measured
            result = {"title": title, "rows": rows, **extra}
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        emit(title, COLUMNS, rows, True, extra=extra)
        return
    emit(title, COLUMNS, rows, False)
    emit("Beside torch.utils.checkpoint and SAC at the same memory", TORCH_COLUMNS, rows, False,
         extra=extra)  # fmt: skip


if __name__ == "__main__":
    main()
