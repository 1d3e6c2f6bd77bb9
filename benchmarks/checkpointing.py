"""Checkpointing benchmark: real runs of ResNet-101 in one process, side by side.

Rows: plain autograd; torch.utils.checkpoint.checkpoint_sequential at the three segment counts
whose measured memory is lowest (every count is measured once) and at sqrt(l) (its best = least
measured activation memory); edgetrain's
sequential, revolve and optimal plans at recompute factors 1.25, 1.5 and 2; and optimal plans given
torch's best memory and 0.55 x of it.

Columns: measured activation memory (the step's peak minus what was held before it: weights,
gradients, input), edgetrain's predicted activation peak, median step time over interleaved rounds
(``step_s``: process CPU time, at one torch thread by default, which other jobs on a shared machine
do not stretch; ``wall_s`` beside it), and the measured recompute factor (CPU time over plain
autograd's, paired: the median over rounds of the step over plain's in the same round, as the
time ratios checked below the table are).

    python benchmarks/checkpointing.py                 # batch 4, 160x160: a few minutes
    python benchmarks/checkpointing.py --batch 8 --image 224 --json
    python benchmarks/checkpointing.py --captured --batch 8 --image 224 --rounds 3

``--captured``: edgetrain's rows train the same network written as an ordinary module
(``resnet101-module``, the Sequential form's weights loaded into it), captured and cut at every
admissible position (inside the residual blocks too), instead of the Sequential's one stage per
block; torch's rows stay ``checkpoint_sequential`` on the Sequential form. Only the rows the
targets need are run (plain, torch's, store-all, at torch's best, at 0.55 x it, and the
least memory edgetrain can plan).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint_sequential

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, interleaved_samples, paired_ratio, sample_medians, step_peak_bytes

from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget
from edgetrain.frontend.profiling import profile_chain
from edgetrain.models import build
from edgetrain.models.resnet_module import module_state
from edgetrain.planners.search import least_memory_of
from edgetrain.planners.sequential import sequential
from edgetrain.runtime.checkpointed import Checkpointed

MiB = 2**20


@dataclass
class Row:
    config: str
    measured: int | None = None
    predicted: int | None = None
    plan_rho: float | None = None
    step_s: float | None = None  # process CPU time
    wall_s: float | None = None
    measured_rho: float | None = None  # step over plain's, paired by round
    note: str = ""

    def output(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "measured_act_MiB": None if self.measured is None else self.measured / MiB,
            "predicted_act_MiB": None if self.predicted is None else self.predicted / MiB,
            "measured/predicted": (
                self.measured / self.predicted if self.measured and self.predicted else None
            ),
            "plan_rho": self.plan_rho,
            "step_s": self.step_s,
            "wall_s": self.wall_s,
            "measured_rho": self.measured_rho,
            "note": self.note or None,
        }


def _step(
    owner: torch.nn.Module, module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> None:
    """One training step of ``module`` on ``x``, ``owner``'s gradients kept (zeroed in place)."""
    for p in owner.parameters():
        assert p.grad is not None
        p.grad.zero_()
    module(x).logsumexp(1).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="resnet101")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--image", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (median reported)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: process CPU time is then robust to other jobs on the machine)",
    )
    parser.add_argument(
        "--captured",
        action="store_true",
        help="edgetrain plans the -module form captured and cut inside its blocks",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = build(args.model)
    x = torch.randn(args.batch, 3, args.image, args.image)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients are held before the step, as after step one
    chain = profile_chain(model, x, repeats=3)
    ours_model, ours_chain = model, chain
    if args.captured:
        ours_model = build(f"{args.model}-module")
        ours_model.load_state_dict(module_state(model.state_dict()))
        for p in ours_model.parameters():
            p.grad = torch.zeros_like(p)
        ours_chain = Checkpointed(ours_model, x).chain  # captured, cut everywhere, profiled
    children = list(model.children())
    rows: list[Row] = []
    steps: dict[str, Callable[[], None]] = {}

    def add(
        row: Row, module: Callable[[torch.Tensor], torch.Tensor], owner: torch.nn.Module = model
    ) -> Row:
        step = functools.partial(_step, owner, module, x)
        row.measured = step_peak_bytes(step)
        rows.append(row)
        steps[row.config] = step
        return row

    def torch_sequential(segments: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda inp: checkpoint_sequential(children, segments, inp, use_reentrant=False)

    def add_plan(name: str, **kwargs: Any) -> Row:
        try:
            net = Checkpointed(ours_model, x, chain=ours_chain, **kwargs)
        except InfeasibleBudget as exc:
            row = Row(name, note=f"infeasible: {exc}")
            rows.append(row)
            return row
        return add(
            Row(name, predicted=net.cost.peak_bytes, plan_rho=net.cost.recompute_factor),
            net,
            ours_model,
        )

    plain = add(
        Row(
            "plain autograd",
            predicted=simulate(chain, sequential(chain, 1)).peak_bytes,
            plan_rho=1.0,
        ),
        model,
    )
    torch_costs = {s: simulate(chain, sequential(chain, s)) for s in range(2, chain.length + 1)}
    # torch's own memory use is not what the simulator predicts for its plan (it frees
    # differently), so its best is found by measuring every segment count, not by prediction.
    swept = {
        s: step_peak_bytes(functools.partial(_step, model, torch_sequential(s), x))
        for s in torch_costs
    }
    promising = sorted(swept, key=lambda s: swept[s])[:3]
    torch_rows = [
        add(
            Row(
                f"torch checkpoint_sequential s={s}",
                predicted=torch_costs[s].peak_bytes,
                plan_rho=torch_costs[s].recompute_factor,
            ),
            torch_sequential(s),
        )
        for s in sorted({*promising, max(2, round(math.sqrt(chain.length)))})
    ]
    best_torch = min(torch_rows, key=lambda r: r.measured or 0)
    assert best_torch.measured is not None
    fixed = Checkpointed(ours_model, x, chain=ours_chain).fixed_bytes
    store_all = add_plan("edgetrain store-all", strategy="optimal")
    if args.captured:
        least = least_memory_of(ours_chain, grads_exist=True)
        add_plan("edgetrain optimal @ least memory", memory_budget=fixed + int(least))
    else:
        for rho in (1.25, 1.5, 2.0):
            for strategy in ("sequential", "revolve", "optimal"):
                add_plan(f"edgetrain {strategy} rho<={rho}", strategy=strategy, max_recompute=rho)
    at_best = add_plan(
        "edgetrain optimal @ torch-best memory", memory_budget=fixed + best_torch.measured
    )
    at_055 = add_plan(
        "edgetrain optimal @ 0.55 x torch-best",
        memory_budget=fixed + int(0.55 * best_torch.measured),
    )

    samples = interleaved_samples(steps, rounds=args.rounds)
    for name, runs in samples.items():
        row = next(r for r in rows if r.config == name)
        row.step_s, row.wall_s = sample_medians(runs)
        row.measured_rho = paired_ratio(samples, name, plain.config)[0]
    assert plain.step_s is not None and best_torch.step_s is not None
    ours = [r for r in rows if r.config.startswith("edgetrain") and r.measured and r.predicted]
    worst = max(abs((r.measured or 0) / (r.predicted or 1) - 1) for r in ours)

    def ratio(a: float | None, b: float | None) -> str:
        return "n/a (infeasible)" if a is None or b is None else f"{a / b:.3f}"

    def time_ratio(a: Row, b: Row) -> str:
        """CPU time of ``a``'s step over ``b``'s, paired by round (see ``paired_ratio``)."""
        if a.config not in samples or b.config not in samples:
            return "n/a (infeasible)"
        return f"{paired_ratio(samples, a.config, b.config)[0]:.3f}"

    checks = {
        "store-all step time / plain (target <= 1.03)": time_ratio(store_all, plain),
        "largest |measured/predicted - 1| of edgetrain rows (target <= 0.05)": f"{worst:.4f}",
        "optimal @ torch-best memory: activation memory / torch-best (target <= 1)": ratio(
            at_best.measured, best_torch.measured
        ),
        "optimal @ torch-best memory: step time / torch-best's (target <= 1)": time_ratio(
            at_best, best_torch
        ),
        "optimal @ 0.55 x torch-best: activation memory / torch-best (target <= 0.55)": ratio(
            at_055.measured, best_torch.measured
        ),
        "optimal @ 0.55 x torch-best: step time / plain (target <= 2)": time_ratio(at_055, plain),
        "least memory of any optimal plan / torch-best": ratio(
            min(r.measured or math.inf for r in ours), best_torch.measured
        ),
        "torch-best configuration": best_torch.config,
        "setting": f"{args.model}, {chain.length} stages"
        + (f" (edgetrain: {ours_chain.length} captured)" if args.captured else "")
        + f", batch {args.batch}, "
        f"{args.image}x{args.image}, {args.rounds} interleaved rounds, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
    }
    emit(
        "Checkpointing: activation memory and step time, measured side by side",
        [
            "config",
            "measured_act_MiB",
            "predicted_act_MiB",
            "measured/predicted",
            "plan_rho",
            "step_s",
            "wall_s",
            "measured_rho",
            "note",
        ],
        [r.output() for r in rows],
        args.json,
        {"checks": checks},
    )


if __name__ == "__main__":
    main()
