"""Ready in seconds: how long ``Checkpointed`` takes to profile a model, sized on meta tensors and
timed by the device model, against measuring every stage; and how far the plans move.

For each model (torchvision's, built from code, no weights), captured and cut once
(``as_stages``, as ``Checkpointed`` does; ``capture_s``):

* ``modelled_s``: ``profile_chain(timing="modelled")``, the profile ``Checkpointed`` makes:
  every stage sized on meta tensors and timed by :class:`~edgetrain.frontend.device_speed.
  DeviceSpeed` (this machine's timed operators, cached once per machine beforehand). Median
  wall seconds of ``--rounds`` runs, each with the memo of meta kernels emptied
  (:func:`edgetrain.autograd.meta_memo.forget`): what a new process pays.
* ``measured_s``: ``profile_chain()`` timing every stage (``--measured-rounds``, 0 skips it).
* ``same_bytes``: whether the two chains' byte counts agree (:meth:`Chain.fingerprint`): the
  measured peak then equals the prediction either way.
* per budget fraction f (of the way from the smallest budget that plans to the store-all
  plan's peak; the parameter gradients a step creates count): the plan made on each chain, its
  predicted peak, and the recompute factor ρ of both plans judged on the *measured* chain's
  times (``rho_measured_plan``, ``rho_modelled_plan``): how much slower the plan made without
  timing runs, by the timings that the measured profile would have planned on.

The machine is shared: wall seconds stretch with other jobs (the load average is in the JSON).

    python benchmarks/ready.py --json > benchmarks/data/ready_resnet50_vit_b16_4x128.json
    python benchmarks/ready.py --models resnet50 --measured-rounds 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
from _common import emit

from edgetrain.autograd import meta_memo
from edgetrain.core.chain import Chain
from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget
from edgetrain.frontend.cuts import as_stages
from edgetrain.frontend.device_speed import device_speed
from edgetrain.frontend.profiling import profile_chain
from edgetrain.models import thirdparty
from edgetrain.planners.search import plan

MODELS = ("resnet50", "vit_b_16")


def _model(name: str, batch: int, side: int) -> tuple[torch.nn.Module, torch.Tensor]:
    tv = thirdparty.torchvision()
    torch.manual_seed(0)
    kwargs = {"image_size": side} if name.startswith("vit") else {}
    return getattr(tv.models, name)(**kwargs), torch.randn(batch, 3, side, side)


def _timed(run: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def _plans(measured: Chain, modelled: Chain, fraction: float) -> dict[str, Any]:
    """The plans of both chains at ``fraction`` of the way from the smallest budget that plans
    to the store-all plan's peak, judged on ``measured``."""
    kept = {"grads_exist": True}  # gradients kept between steps: the activations' share
    store_all = simulate(measured, plan(measured, **kept), **kept).peak_bytes
    try:
        smallest = simulate(measured, plan(measured, memory=1, **kept), **kept).peak_bytes
    except InfeasibleBudget as exc:
        smallest = int(exc.smallest or store_all)
    budget = int(smallest + fraction * (store_all - smallest))
    mine = plan(measured, memory=budget, **kept)
    theirs = plan(modelled, memory=budget, **kept)
    plain = replace(measured, autograd_peak_bytes=None)
    return {
        f"peak_MB@{fraction}": round(simulate(measured, mine, **kept).peak_bytes / 1e6, 2),
        f"peak_MB_modelled@{fraction}": round(
            simulate(modelled, theirs, **kept).peak_bytes / 1e6, 2
        ),
        f"rho_measured_plan@{fraction}": simulate(plain, mine, **kept).recompute_factor,
        f"rho_modelled_plan@{fraction}": simulate(plain, theirs, **kept).recompute_factor,
    }


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, x = _model(name, args.batch, args.side)
    capture_s, stages = _timed(lambda: as_stages(model, x))
    times = []
    for _ in range(args.rounds):
        meta_memo.forget()
        seconds, modelled = _timed(lambda: profile_chain(stages, x, timing="modelled"))
        times.append(seconds)
    row: dict[str, Any] = {
        "model": f"{name} {args.batch}x{args.side}²",
        "stages": modelled.length,
        "capture_s": capture_s,
        "modelled_s": statistics.median(times),
        "modelled_runs_s": times,
    }
    if args.measured_rounds:
        measured_times = []
        for _ in range(args.measured_rounds):
            seconds, measured = _timed(lambda: profile_chain(stages, x))
            measured_times.append(seconds)
        row["measured_s"] = statistics.median(measured_times)
        row["speedup"] = row["measured_s"] / row["modelled_s"]
        row["same_bytes"] = measured.fingerprint() == modelled.fingerprint()
        if args.save_chains:
            for kind, chain in (("measured", measured), ("modelled", modelled)):
                path = f"{args.save_chains}/{name}_{kind}.json"
                with open(path, "w", encoding="utf-8") as handle:
                    handle.write(chain.to_json())
        row["measured_step_s"] = measured.forward_seconds + measured.backward_seconds
        row["modelled_step_s"] = modelled.forward_seconds + modelled.backward_seconds
        for fraction in args.fractions:
            row.update(_plans(measured, modelled, fraction))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--side", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measured-rounds", type=int, default=1)
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.5])
    parser.add_argument("--save-chains", help="a directory to write both chains to")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    calibrate_s, speed = _timed(device_speed)
    rows = [run_model(name, args) for name in args.models]
    columns = ["model", "stages", "capture_s", "modelled_s", "measured_s", "speedup"]
    columns += ["same_bytes", "measured_step_s", "modelled_step_s"]
    for fraction in args.fractions:
        columns += [f"peak_MB@{fraction}", f"rho_measured_plan@{fraction}"]
        columns += [f"rho_modelled_plan@{fraction}"]
    extra = {
        "device_speed_s": calibrate_s,
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "device_speed": repr(speed),
    }
    emit("Checkpointed's profile: modelled against measured", columns, rows, args.json, extra)


if __name__ == "__main__":
    main()
