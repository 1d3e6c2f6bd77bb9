"""Any-model benchmark: what a PyTorch user can do today to train in less memory, side by side.

For each model (built from code, not nn.Sequential: residuals, long skips, attention, tied
weights), one training step (forward, mean-square loss, backward; gradients then set to None):

* ``plain``: eager autograd.
* ``checkpoint``: ``torch.utils.checkpoint.checkpoint(block, use_reentrant=False)`` around every
  block (residual block, inverted residual, U-Net double convolution, transformer block).
* ``compile@b``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = b``
  (b = 1.0, 0.5, 0.3, 0.1): the min-cut partitioner with a knapsack over what to save. The first
  call compiles (``compile_s``, reported apart; inductor's on-disk caches make a second run
  fast; ``--no-compile`` skips these rows).
* ``edgetrain@f``: the hook :func:`make_edgetrain` (see below) at budgets f × plain's peak.

Memory: ``peak_MiB`` is the most heap memory in use during the step above what was in use when
it started (weights, buffers, input; parameter gradients are allocated during the step and
included), measured by glibc's ``mallinfo2`` sampled in a thread (``_malloc_peak.py``) — one
method for every row, compiled code included (a dispatch mode does not see inside compiled
graphs). Maximum over ``--mem-repeats`` runs (sampling can only miss a peak). For eager rows
``counter_MiB`` is ``StorageCounter``'s exact figure. Time: medians of interleaved rounds, every
configuration of a model run once per round.

    python benchmarks/anymodel.py                     # small sizes, a few minutes + compiles
    python benchmarks/anymodel.py --no-compile --json
    python benchmarks/anymodel.py --models resnet101-module:8:224 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, interleaved_medians
from _malloc_peak import malloc_peak

from edgetrain.errors import EdgetrainError
from edgetrain.measure import StorageCounter
from edgetrain.models import build, canonical_name, sample_input
from edgetrain.models.mobilenetv2 import InvertedResidual
from edgetrain.models.resnet import BasicBlock, Bottleneck
from edgetrain.models.transformer import Block
from edgetrain.models.unet import UNet

MiB = 2**20
COMPILE_BUDGETS = (1.0, 0.5, 0.3, 0.1)
EDGETRAIN_BUDGETS = (1.0, 0.7, 0.5, 0.3)  # fractions of plain autograd's measured peak
# name: (batch, size) — size is the image side, or the sequence length for tinylm.
DEFAULT_MODELS = {
    "resnet50-module": (4, 128),
    "mobilenetv2": (8, 128),
    "unet": (4, 128),
    "vit-tiny": (8, 128),
    "tinylm": (8, 256),
}

Step = Callable[[torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# EDGETRAIN. Rows "edgetrain@f": the model captured and cut into stages (between and inside its
# blocks), profiled on this machine, and planned for an activation budget of f × plain
# autograd's measured ``peak_MiB`` (the step's peak above weights, buffers and input, parameter
# gradients created during the step included: the loop here sets them to None), less what the
# loss itself holds (measured on a tensor of the output's shape).
# ---------------------------------------------------------------------------------------------
def make_edgetrain(model: nn.Module, x: torch.Tensor, budget_bytes: int) -> Step:
    from edgetrain.execute import Checkpointed
    from edgetrain.planners import plan

    profiled = Checkpointed(model, x)  # stores everything; its chain is what is planned on
    # The loss is computed by the caller between the forward and the backward: what it holds
    # (here the square, its gradient and the output's gradient) comes off the model's budget.
    with torch.no_grad():
        shape = model(x).shape
    leaf = torch.zeros(shape, requires_grad=True)
    counter = StorageCounter()
    with counter:
        leaf.float().square().mean().backward()
    schedule = plan(profiled.chain, "optimal", memory=budget_bytes - counter.peak_bytes)
    return Checkpointed(model, x, chain=profiled.chain, schedule=schedule)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """``model`` with every block wrapped in non-reentrant ``torch.utils.checkpoint``."""
    kinds = (BasicBlock, Bottleneck, InvertedResidual, Block)
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, kinds)
    ]
    for unet in [m for m in model.modules() if isinstance(m, UNet)]:  # its double convolutions
        targets.append((unet, "bottom"))
        targets += [(group, str(i)) for group in (unet.down, unet.merge) for i in range(len(group))]
    for parent, name in targets:
        setattr(parent, name, _Checkpoint(getattr(parent, name)))
    return model


class _Checkpoint(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, *args, use_reentrant=False)
        return out


def _training_step(net: Step, params: list[nn.Parameter], x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        net(x).float().square().mean().backward()
        for p in params:  # as zero_grad() would; after the step, so each starts without them
            p.grad = None

    return step


def bench_model(name: str, batch: int, size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = build(name, image=size)
    x = sample_input(name, batch, size)
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    configs: dict[str, Callable[[], None]] = {}
    notes: dict[str, str] = {}
    compile_s: dict[str, float] = {}
    eager: set[str] = set()

    def add(config: str, net: Step, params: list[nn.Parameter], is_eager: bool) -> None:
        configs[config] = _training_step(net, params, x)
        if is_eager:
            eager.add(config)

    plain = copy.deepcopy(base)
    add("plain", plain, list(plain.parameters()), True)
    ckpt = checkpoint_blocks(copy.deepcopy(base))
    add("checkpoint", ckpt, list(ckpt.parameters()), True)
    if args.compile:
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        for budget in args.budgets:
            config = f"compile@{budget:g}"
            model = copy.deepcopy(base)
            # A subclass of its own per budget: dynamo guards on the module's type, so this
            # copy is compiled afresh (a plain copy would reuse the first budget's graphs).
            model.__class__ = type(f"{type(base).__name__}_budget_{budget:g}", (type(base),), {})
            compiled = torch.compile(model)
            step = _training_step(compiled, list(model.parameters()), x)
            _progress(f"{name}: compiling at activation_memory_budget={budget:g}")
            start = time.perf_counter()
            with torch._functorch.config.patch(activation_memory_budget=budget):
                step()  # compiles forward and backward with this budget
            compile_s[config] = time.perf_counter() - start
            configs[config] = step

    peaks: dict[str, int] = {}
    counted: dict[str, int] = {}
    configs["plain"]()  # warm up before measuring plain's peak (the edgetrain budgets use it)
    peaks["plain"] = _peak(configs["plain"], args.mem_repeats)
    if args.edgetrain:
        for fraction in EDGETRAIN_BUDGETS:
            config = f"edgetrain@{fraction:g}"
            model = copy.deepcopy(base)
            try:
                net = make_edgetrain(model, x, int(fraction * peaks["plain"]))
            except EdgetrainError as exc:
                notes[config] = str(exc)
                if fraction == EDGETRAIN_BUDGETS[0]:  # refused outright: one row says why
                    notes = {"edgetrain": str(exc)}
                    break
                continue
            add(config, net, list(model.parameters()), True)

    for config, step in configs.items():
        step()  # warm-up (and, for compiled rows, any lazy backward compile)
        if config != "plain":
            peaks[config] = _peak(step, args.mem_repeats)
        if config in eager:
            counter = StorageCounter()
            with counter:
                step()
            counted[config] = counter.peak_bytes
    _progress(f"{name}: timing {len(configs)} configurations, {args.rounds} rounds")
    times = interleaved_medians(configs, rounds=args.rounds, warmup=0)

    rows = []
    for config in [*configs, *notes]:
        step_s = times.get(config)
        reference = times.get("compile@1")
        rows.append(
            {
                "model": f"{name} b{batch} {size}",
                "config": config,
                "peak_MiB": peaks[config] / MiB if config in peaks else None,
                "counter_MiB": counted[config] / MiB if config in counted else None,
                "mem/plain": peaks[config] / peaks["plain"] if config in peaks else None,
                "step_s": step_s,
                "step/plain": step_s / times["plain"] if step_s else None,
                "step/compile@1": (
                    step_s / reference
                    if step_s and reference and config.startswith("compile")
                    else None
                ),
                "compile_s": compile_s.get(config),
                "weights_MiB": weights / MiB,
                "note": notes.get(config),
            }
        )
    return rows


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _peak(step: Callable[[], None], repeats: int) -> int:
    return max(malloc_peak(step) for _ in range(repeats))


def _parse_models(text: str | None) -> dict[str, tuple[int, int]]:
    if not text:
        return dict(DEFAULT_MODELS)
    models = {}
    for item in text.split(","):
        name, *rest = item.strip().split(":")
        key = canonical_name(name)
        batch, size = (int(rest[0]), int(rest[1])) if rest else DEFAULT_MODELS.get(key, (4, 128))
        models[key] = (batch, size)
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", help="name[:batch:size],...  (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (median reported)")
    parser.add_argument("--mem-repeats", type=int, default=3, help="memory runs (max reported)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument(
        "--budgets",
        default=",".join(f"{b:g}" for b in COMPILE_BUDGETS),
        help="torch.compile activation_memory_budget values",
    )
    parser.add_argument("--edgetrain", action="store_true", help="add the edgetrain hook's rows")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.budgets = [float(b) for b in args.budgets.split(",")]
    torch.set_num_threads(args.threads)
    models = _parse_models(args.models)
    rows = []
    for name, (batch, size) in models.items():
        rows += bench_model(name, batch, size, args)
    columns = [
        "model", "config", "peak_MiB", "counter_MiB", "mem/plain", "step_s", "step/plain",
        "step/compile@1", "compile_s", "note",
    ]  # fmt: skip
    emit(
        "Training step of models with a forward(): peak memory and time",
        columns,
        rows,
        args.json,
        extra={
            "memory": "glibc mallinfo2 (uordblks + hblkhd) sampled in a thread, peak above start",
            "setting": f"torch {torch.__version__}, {args.threads} threads, "
            f"{args.rounds} interleaved rounds",
        },
    )


if __name__ == "__main__":
    main()
