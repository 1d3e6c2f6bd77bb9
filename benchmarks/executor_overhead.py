"""Executor overhead: a Checkpointed step over a plain eager step, against what the plan predicts.

For each model (built from code, captured and cut into stages as ``Checkpointed`` does), one
training step (forward, mean-square loss, backward; gradients then set to None) for:

* ``plain``: eager autograd on the model;
* ``store-all``: ``Checkpointed`` with a plan that stores everything (it runs the model as it is:
  plain autograd);
* ``store-all via executor``: the same plan run stage by stage through the executor (a
  diagnostic: what the executor costs when nothing is recomputed);
* ``budget f``: the optimal plan for f × plain's peak (``StorageCounter``, parameter gradients
  included) less what the loss holds; ``least``: the smallest budget that has a plan. Each plan
  twice: as ``Checkpointed`` runs it (its graph runs, stored or with rebuilt outputs, merged
  into one stage each where that fits) and ``stage by stage`` (no run merged); ``stages_run``
  counts the stages run.

``rho_pred`` is the plan's recompute factor from the profiled stage times (the time the planner
predicts, over plain's); ``cpu/plain`` and ``wall/plain`` are measured in interleaved rounds of
process CPU time (robust to other jobs on a shared machine: one torch thread) and wall time,
paired: the median over rounds of the row's step over plain's in the same round.
``cpu/plain - rho_pred`` is what the executor costs beyond the compute the planner counts.

    python benchmarks/executor_overhead.py [--models vit-tiny:8:128,...] [--rounds 7] [--json]

``--per-stage`` measures instead what the executor adds per stage, where compute is negligible:
a chain of 126 ``Linear(4, 4)`` stages (ViT-Tiny's count), each of which first writes
``--traffic`` MiB of one buffer under no grad (0: nothing), the way a real stage's kernels
pass megabytes through the caches between two runs of the executor's Python. Rows: the
forward (with grad) and the backward of plain eager autograd on the module and of the store-all
plan run stage by stage through the executor, in µs per stage (medians of interleaved rounds,
wall clock, garbage collection off while timing), and the executor's excess over plain.

    python benchmarks/executor_overhead.py --per-stage [--traffic 0,1,4,16] [--rounds 30] [--json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, interleaved_samples, paired_ratio, sample_medians, step_peak_bytes

from edgetrain.errors import InfeasibleBudget
from edgetrain.models import build, canonical_name, sample_input
from edgetrain.planners import plan
from edgetrain.planners.optimal import store_all
from edgetrain.runtime.checkpointed import Checkpointed

DEFAULT_MODELS = "resnet50-module:8:112,vit-tiny:8:128"
FRACTIONS = ("1.0", "0.7", "0.5", "least")
MiB = 2**20


def _step(net: Any, params: list[torch.nn.Parameter], x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        net(x).float().square().mean().backward()
        for p in params:
            p.grad = None

    return step


def bench_model(name: str, batch: int, size: int, rounds: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = build(name, image=size)
    x = sample_input(name, batch, size)
    plain = copy.deepcopy(base)
    steps: dict[str, Callable[[], None]] = {"plain": _step(plain, list(plain.parameters()), x)}
    steps["plain"]()
    plain_peak = step_peak_bytes(steps["plain"])
    chain = Checkpointed(copy.deepcopy(base), x).chain  # profiled once, shared by every plan
    with torch.no_grad():
        shape = base(x).shape
    loss_bytes = step_peak_bytes(
        lambda: torch.zeros(shape, requires_grad=True).square().mean().backward()
    )
    try:
        plan(chain, "optimal", memory=1)
        least = 1
    except InfeasibleBudget as exc:
        least = int(exc.smallest or 1)
    nets: dict[str, Checkpointed] = {}

    def add(config: str, schedule: Any, through_executor: bool = False, merge: bool = True) -> None:
        model = copy.deepcopy(base)
        net = Checkpointed(model, x, chain=chain, schedule=schedule, merge_graph_runs=merge)
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
        label = f"budget {(budget + loss_bytes) / plain_peak:.2f}"
        add(label, schedule)
        add(f"{label}, stage by stage", schedule, merge=False)

    samples = interleaved_samples(steps, rounds=rounds)
    paired = {c: paired_ratio(samples, c, "plain") for c in steps}  # (cpu, wall) over plain's
    rows = []
    for config in steps:
        net = nets.get(config)
        rho = net.cost.recompute_factor if net is not None else 1.0
        rows.append(
            {
                "model": f"{name} b{batch} {size} ({chain.length} stages)",
                "config": config,
                "stages_run": net._exec_length if net is not None else None,
                "peak_MiB": ((net.cost.peak_bytes if net is not None else plain_peak) / MiB),
                "rho_pred": rho,
                "cpu/plain": paired[config][0],
                "wall/plain": paired[config][1],
                "cpu/plain - rho_pred": paired[config][0] - rho,
                "plain_cpu_s": sample_medians(samples["plain"])[0],
                "predicted_plain_s": chain.forward_seconds + chain.backward_seconds,
            }
        )
    return rows


class _Traffic(torch.nn.Module):
    """A ``Linear(4, 4)`` stage that first writes ``scratch`` (shared by all stages; no grad)."""

    def __init__(self, scratch: torch.Tensor | None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scratch = scratch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scratch is not None:
            with torch.no_grad():
                self.scratch.add_(1.0)
        return self.linear(x)


def bench_per_stage(traffic: int, rounds: int, stages: int = 126) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    scratch = torch.zeros(traffic * MiB // 4) if traffic else None
    model = torch.nn.Sequential(*(_Traffic(scratch) for _ in range(stages)))
    x = torch.randn(2, 4)
    chain = Checkpointed(copy.deepcopy(model), x).chain
    chain = dataclasses.replace(chain, autograd_peak_bytes=None)  # store-all: not the module
    executor = Checkpointed(copy.deepcopy(model), x, chain=chain, schedule=store_all(chain))
    executor._stores_everything = False  # run the store-all plan stage by stage
    nets: dict[str, torch.nn.Module] = {"plain": model, "executor": executor}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in nets}

    def step(name: str) -> None:
        net = nets[name]
        start = time.perf_counter()
        loss = net(x).square().mean()
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        for p in net.parameters():
            p.grad = None
        times[name].append((middle - start, end - middle))

    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(2):
            for name in nets:
                step(name)
        for name in nets:
            times[name].clear()
        for _ in range(rounds):
            for name in nets:
                step(name)
    finally:
        if enabled:
            gc.enable()
    us = {
        name: [statistics.median(t[i] for t in samples) * 1e6 / stages for i in (0, 1)]
        for name, samples in times.items()
    }
    return [
        {
            "traffic_MiB": traffic,
            "plain_fwd_us": us["plain"][0],
            "executor_fwd_us": us["executor"][0],
            "plain_bwd_us": us["plain"][1],
            "executor_bwd_us": us["executor"][1],
            "excess_us": us["executor"][0] + us["executor"][1] - us["plain"][0] - us["plain"][1],
        }
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="name:batch:size,...")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--per-stage", action="store_true", help="the executor's cost per stage")
    parser.add_argument("--traffic", default="0,1,4,16", help="MiB written between stages")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.per_stage:
        rounds = max(args.rounds, 30)
        per_stage = []
        for mib in args.traffic.split(","):
            per_stage += bench_per_stage(int(mib), rounds)
        emit(
            "What the executor adds per stage (126 Linear(4, 4) stages), us per stage",
            list(per_stage[0]),
            per_stage,
            args.json,
            extra={
                "setting": f"torch {torch.__version__}, {args.threads} threads, "
                f"{rounds} interleaved rounds, medians, wall clock, gc off"
            },
        )
        return
    rows = []
    for item in args.models.split(","):
        name, batch, size = item.strip().split(":")
        rows += bench_model(canonical_name(name), int(batch), int(size), args.rounds)
    columns = ["model", "config", "stages_run", "peak_MiB", "rho_pred", "cpu/plain", "wall/plain"]
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
