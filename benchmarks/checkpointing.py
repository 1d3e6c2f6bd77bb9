"""Checkpointing benchmark: real runs of ResNet-101 in one process, side by side.

Rows: plain autograd; torch.utils.checkpoint.checkpoint_sequential at its best segment count
(least activation memory) and at sqrt(l) segments; edgetrain's sequential, revolve and optimal plans
at recompute factors 1.25, 1.5 and 2; and two optimal plans tied to torch's best configuration.

Columns: measured activation memory (the step's peak minus what was held before it: weights,
gradients, input), edgetrain's predicted activation peak, median step time over interleaved rounds,
and the measured recompute factor (step time over plain autograd's). Targets are checked at the end.

    python benchmarks/checkpointing.py                 # batch 4, 160x160: a few minutes
    python benchmarks/checkpointing.py --batch 8 --image 224 --json
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint_sequential

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, interleaved_medians  # noqa: E402

from edgetrain.errors import InfeasibleBudget  # noqa: E402
from edgetrain.execute import Checkpointed  # noqa: E402
from edgetrain.measure import StorageCounter  # noqa: E402
from edgetrain.models import build  # noqa: E402
from edgetrain.planners.sequential import sequential  # noqa: E402
from edgetrain.profile import profile  # noqa: E402
from edgetrain.schedule import simulate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet101")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--image", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (median reported)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = build(args.model)
    x = torch.randn(args.batch, 3, args.image, args.image)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients are held before the step, as after step one
    chain = profile(model, x, repeats=3)
    children = list(model.children())
    length = chain.length

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return out.logsumexp(1).sum()

    def run(module: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            for p in model.parameters():
                assert p.grad is not None
                p.grad.zero_()
            loss_of(module(x)).backward()

        return step

    def torch_sequential(segments: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda inp: checkpoint_sequential(children, segments, inp, use_reentrant=False)

    rows: list[dict[str, object]] = []
    steps: dict[str, Callable[[], None]] = {}

    def add(
        name: str,
        module: Callable[[torch.Tensor], torch.Tensor],
        predicted: int | None,
        plan_rho: float | None,
    ) -> None:
        step = run(module)
        counter = StorageCounter()
        with counter:
            step()
        rows.append(
            {
                "config": name,
                "measured_act_MiB": counter.peak_bytes / 2**20,
                "predicted_act_MiB": None if predicted is None else predicted / 2**20,
                "plan_rho": plan_rho,
                "_measured": counter.peak_bytes,
                "_predicted": predicted,
            }
        )
        steps[name] = step

    add("plain autograd", model, simulate(chain, sequential(chain, 1)).peak_bytes, 1.0)
    # torch's checkpoint_sequential: every segment count predicted, the promising ones measured.
    predicted_torch = {s: simulate(chain, sequential(chain, s)) for s in range(2, length + 1)}
    candidates = sorted(predicted_torch, key=lambda s: predicted_torch[s].peak_bytes)[:4]
    sqrt_segments = max(2, round(math.sqrt(length)))
    for s in sorted({*candidates, sqrt_segments}):
        add(
            f"torch checkpoint_sequential s={s}",
            torch_sequential(s),
            predicted_torch[s].peak_bytes,
            predicted_torch[s].recompute_factor,
        )
    torch_rows = [r for r in rows if str(r["config"]).startswith("torch")]
    best_torch = min(torch_rows, key=lambda r: int(r["_measured"]))  # type: ignore[arg-type]
    best_torch_bytes = int(best_torch["_measured"])  # type: ignore[arg-type]

    def add_plan(name: str, **kwargs: object) -> None:
        try:
            net = Checkpointed(model, x, chain=chain, **kwargs)  # type: ignore[arg-type]
        except InfeasibleBudget as exc:
            rows.append({"config": name, "note": f"infeasible: {exc}"})
            return
        add(name, net, net.cost.peak_bytes, net.cost.recompute_factor)

    fixed = Checkpointed(model, x, chain=chain).fixed_bytes
    add_plan("edgetrain store-all", strategy="optimal")
    for rho in (1.25, 1.5, 2.0):
        for strategy in ("sequential", "revolve", "optimal"):
            add_plan(f"edgetrain {strategy} rho<={rho}", strategy=strategy, max_recompute=rho)
    add_plan(
        "edgetrain optimal @ torch-best memory",
        strategy="optimal",
        memory_budget=fixed + best_torch_bytes,
    )
    add_plan(
        "edgetrain optimal @ 0.55 x torch-best",
        strategy="optimal",
        memory_budget=fixed + int(0.55 * best_torch_bytes),
    )

    times = interleaved_medians(steps, rounds=args.rounds)
    plain_time = times["plain autograd"]
    for row in rows:
        name = str(row["config"])
        if name in times:
            row["step_s"] = times[name]
            row["measured_rho"] = times[name] / plain_time
            if row["_predicted"]:
                row["measured/predicted"] = int(row["_measured"]) / int(row["_predicted"])  # type: ignore[arg-type]

    by_name = {str(r["config"]): r for r in rows}
    best_torch_time = float(best_torch["step_s"])  # type: ignore[arg-type]
    ours = [r for n, r in by_name.items() if n.startswith("edgetrain") and "step_s" in r]
    at_best = by_name["edgetrain optimal @ torch-best memory"]
    at_055 = by_name["edgetrain optimal @ 0.55 x torch-best"]
    checks = {
        "store-all time / plain time <= 1.03": f"{float(by_name['edgetrain store-all']['step_s']) / plain_time:.3f}",  # type: ignore[arg-type]
        "max |measured/predicted - 1| <= 0.05 (edgetrain rows)": f"{max(abs(float(r['measured/predicted']) - 1) for r in ours):.4f}",  # type: ignore[arg-type]
        "optimal @ torch-best memory: memory / torch-best <= 1": f"{int(at_best['_measured']) / best_torch_bytes:.3f}",  # type: ignore[arg-type]
        "optimal @ torch-best memory: time / torch-best time <= 1": f"{float(at_best['step_s']) / best_torch_time:.3f}",  # type: ignore[arg-type]
        "optimal @ 0.55 x torch-best: memory / torch-best <= 0.55": f"{int(at_055['_measured']) / best_torch_bytes:.3f}"
        if "step_s" in at_055
        else "n/a",  # type: ignore[arg-type]
        "optimal @ 0.55 x torch-best: time / plain time <= 2": f"{float(at_055['step_s']) / plain_time:.3f}"
        if "step_s" in at_055
        else "n/a",  # type: ignore[arg-type]
        "torch-best configuration": str(best_torch["config"]),
        "setting": f"{args.model}, {length} stages, batch {args.batch}, "
        f"{args.image}x{args.image}, {args.rounds} interleaved rounds, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
    }
    for row in rows:
        row.pop("_measured", None)
        row.pop("_predicted", None)
    emit(
        "Checkpointing: activation memory and step time, measured side by side",
        [
            "config",
            "measured_act_MiB",
            "predicted_act_MiB",
            "measured/predicted",
            "plan_rho",
            "step_s",
            "measured_rho",
            "note",
        ],
        rows,
        args.json,
        {"checks": checks},
    )


if __name__ == "__main__":
    main()
