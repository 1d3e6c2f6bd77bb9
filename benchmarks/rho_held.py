"""``max_recompute`` held in time: a Checkpointed step under ``max_recompute=rho`` over plain
autograd's step, measured, with and without the executor's costs in the plan.

For each model and rho, two plans on one profile: ``executor in`` (what ``Checkpointed`` does:
the executor's costs, :func:`edgetrain.runtime.checkpointed.executor_seconds`, measured on this
machine: per stage operation, per unit rebuilt inside a graph run and per stage computed again,
are in the planned time) and ``executor 0`` (the stages' compute only, as the planners count
it). Columns: how the step runs, the plan's compute recompute factor (``rho_compute``), the
predicted factor with the executor's costs (``rho_pred``), and the measured ``cpu/plain``: the
median over interleaved rounds of the step's process CPU time over plain autograd's in the same
round (one torch thread; the loss a mean square; gradients set to None). A row keeps to rho when
``cpu/plain <= rho`` within the machine's resolution (paired ratios of two copies of the same
step, the last row).

    python benchmarks/rho_held.py [--models mobilenetv2:8:96,tv/mobilenet_v3_small:8:96]
                                  [--rhos 1.25,1.5]
                                  [--rounds 15] [--json]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, interleaved_samples, paired_ratio

from edgetrain.models import build, sample_input, thirdparty
from edgetrain.runtime.checkpointed import Checkpointed, executor_seconds
from edgetrain.runtime.stage_cost import ExecutorSeconds

DEFAULT_MODELS = "mobilenetv2:8:96,vit-tiny:8:64"


def _step(net: Any, params: list[torch.nn.Parameter], x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        net(x).float().square().mean().backward()
        for p in params:
            p.grad = None

    return step


def _model(name: str, batch: int, size: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """A registry model, or a torchvision one named ``tv/<name>`` (e.g. ``tv/mobilenet_v3_small``),
    with its input."""
    if name.startswith("tv/"):
        model = getattr(thirdparty.torchvision().models, name[3:])(num_classes=10)
        return model, torch.randn(batch, 3, size, size)
    return build(name, image=size), sample_input(name, batch, size)


def _set_costs(cost: ExecutorSeconds, factor: float) -> None:
    """Plan with the executor's costs (``factor`` 1) or without them (0)."""
    os.environ["EDGETRAIN_STAGE_SECONDS"] = repr(cost.operation * factor)
    os.environ["EDGETRAIN_REBUILD_SECONDS"] = repr(cost.rebuild * factor)
    os.environ["EDGETRAIN_REBUILT_STAGE_SECONDS"] = repr(cost.rebuilt_stage * factor)


def bench(name: str, batch: int, size: int, rhos: list[float], rounds: int) -> list[dict]:
    torch.manual_seed(0)
    base, x = _model(name, batch, size)
    chain = Checkpointed(copy.deepcopy(base), x).chain
    cost = executor_seconds()
    nets: dict[str, Checkpointed] = {}
    for rho in rhos:
        for label, factor in (("in", 1.0), ("0", 0.0)):
            _set_costs(cost, factor)
            nets[f"{rho}|{label}"] = Checkpointed(
                copy.deepcopy(base), x, max_recompute=rho, chain=chain
            )
    _set_costs(cost, 1.0)
    plain, twin = copy.deepcopy(base), copy.deepcopy(base)
    steps = {"plain": _step(plain, list(plain.parameters()), x)}
    steps["plain again"] = _step(twin, list(twin.parameters()), x)  # the resolution
    for key, net in nets.items():
        steps[key] = _step(net, list(net.parameters()), x)
    samples = interleaved_samples(steps, rounds, warmup=2)
    rows = []
    for key, net in nets.items():
        rho, label = key.split("|")
        cpu, wall = paired_ratio(samples, key, "plain")
        rows.append(
            {
                "model": f"{name} b{batch} {size}",
                "rho": float(rho),
                "executor": label,
                "runs as": net.runs_as,
                "rho_compute": net.cost.recompute_factor,
                "rho_pred": net.predicted_recompute_factor,
                "cpu/plain": cpu,
                "wall/plain": wall,
                "held": "yes" if cpu <= float(rho) else "no",
            }
        )
    cpu, wall = paired_ratio(samples, "plain again", "plain")
    rows.append({"model": f"{name} b{batch} {size}", "runs as": "plain again (resolution)",
                 "cpu/plain": cpu, "wall/plain": wall})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--rhos", default="1.25,1.5")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rhos = [float(r) for r in args.rhos.split(",")]
    rows = []
    for spec in args.models.split(","):
        name, batch, size = spec.split(":")
        rows += bench(name, int(batch), int(size), rhos, args.rounds)
    cost = executor_seconds()
    emit(
        f"max_recompute held in time (executor: {cost.operation * 1e6:.0f} us per stage "
        f"operation, {cost.rebuild * 1e6:.0f} us per unit rebuilt, "
        f"{cost.rebuilt_stage * 1e6:.0f} us per stage computed again)",
        list(rows[0]),
        rows,
        args.json,
        {"executor_seconds": asdict(cost)},
    )


if __name__ == "__main__":
    main()
