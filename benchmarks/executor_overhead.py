"""Executor overhead: a Checkpointed step over a plain eager step, against what the plan predicts.

For each model (built from code, captured and cut into stages as ``Checkpointed`` does), one
training step (forward, mean-square loss, backward; gradients then set to None) for:

* ``plain``: eager autograd on the model;
* ``store-all``: ``Checkpointed`` with a plan that stores everything (it runs the model as it is:
  plain autograd);
* ``store-all via executor``: the same plan run stage by stage through the executor (a
  diagnostic: what the executor costs when nothing is recomputed);
* ``budget f``: the optimal plan for f × plain's peak (``StorageCounter``, parameter gradients
  included) less what the loss holds; ``least``: the smallest budget that has a plan.

``rho_pred`` is the plan's recompute factor from the profiled stage times (the time the planner
predicts, over plain's); ``cpu/plain`` and ``wall/plain`` are measured: medians of interleaved
rounds of process CPU time (robust to other jobs on a shared machine: one torch thread) and wall
time. ``cpu/plain - rho_pred`` is what the executor costs beyond the compute the planner counts.

    python benchmarks/executor_overhead.py [--models vit-tiny:8:128,...] [--rounds 7] [--json]
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, interleaved_cpu_wall

from edgetrain.errors import InfeasibleBudget
from edgetrain.execute import Checkpointed
from edgetrain.measure import StorageCounter
from edgetrain.models import build, canonical_name, sample_input
from edgetrain.planners import plan
from edgetrain.planners.optimal import store_all

DEFAULT_MODELS = "resnet50-module:8:112,vit-tiny:8:128"
FRACTIONS = ("1.0", "0.7", "0.5", "least")
MiB = 2**20


def _step(net: Any, params: list[torch.nn.Parameter], x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        net(x).float().square().mean().backward()
        for p in params:
            p.grad = None

    return step


def _peak(step: Callable[[], None]) -> int:
    counter = StorageCounter()
    with counter:
        step()
    return counter.peak_bytes


def bench_model(name: str, batch: int, size: int, rounds: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = build(name, image=size)
    x = sample_input(name, batch, size)
    plain = copy.deepcopy(base)
    steps: dict[str, Callable[[], None]] = {"plain": _step(plain, list(plain.parameters()), x)}
    steps["plain"]()
    plain_peak = _peak(steps["plain"])
    chain = Checkpointed(copy.deepcopy(base), x).chain  # profiled once, shared by every plan
    with torch.no_grad():
        shape = base(x).shape
    loss_bytes = _peak(lambda: torch.zeros(shape, requires_grad=True).square().mean().backward())
    try:
        plan(chain, "optimal", memory=1)
        least = 1
    except InfeasibleBudget as exc:
        least = int(exc.smallest or 1)
    nets: dict[str, Checkpointed] = {}

    def add(config: str, schedule: Any, through_executor: bool = False) -> None:
        model = copy.deepcopy(base)
        net = Checkpointed(model, x, chain=chain, schedule=schedule)
        if through_executor:
            net._stores_everything = False  # run the store-all plan stage by stage
        nets[config] = net
        steps[config] = _step(net, list(model.parameters()), x)

    add("store-all", store_all(chain))
    add("store-all via executor", store_all(chain), through_executor=True)
    for fraction in FRACTIONS:
        budget = least if fraction == "least" else int(float(fraction) * plain_peak) - loss_bytes
        try:
            schedule = plan(chain, "optimal", memory=budget)
        except InfeasibleBudget:
            continue
        add(f"budget {(budget + loss_bytes) / plain_peak:.2f}", schedule)

    medians = interleaved_cpu_wall(steps, rounds=rounds)
    cpu_s = {c: cpu for c, (cpu, _) in medians.items()}
    wall_s = {c: wall for c, (_, wall) in medians.items()}
    rows = []
    for config in steps:
        net = nets.get(config)
        rho = net.cost.recompute_factor if net is not None else 1.0
        rows.append(
            {
                "model": f"{name} b{batch} {size} ({chain.length} stages)",
                "config": config,
                "peak_MiB": ((net.cost.peak_bytes if net is not None else plain_peak) / MiB),
                "rho_pred": rho,
                "cpu/plain": cpu_s[config] / cpu_s["plain"],
                "wall/plain": wall_s[config] / wall_s["plain"],
                "cpu/plain - rho_pred": cpu_s[config] / cpu_s["plain"] - rho,
                "plain_cpu_s": cpu_s["plain"],
                "predicted_plain_s": chain.forward_seconds + chain.backward_seconds,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="name:batch:size,...")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for item in args.models.split(","):
        name, batch, size = item.strip().split(":")
        rows += bench_model(canonical_name(name), int(batch), int(size), args.rounds)
    columns = ["model", "config", "peak_MiB", "rho_pred", "cpu/plain", "wall/plain"]
    columns.append("cpu/plain - rho_pred")
    emit(
        "Checkpointed step over plain eager step: measured against predicted",
        columns,
        rows,
        args.json,
        extra={
            "setting": f"torch {torch.__version__}, {args.threads} threads, "
            f"{args.rounds} interleaved rounds, medians"
        },
    )


if __name__ == "__main__":
    main()
