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

With ``--ready``, a second table: ``Checkpointed(model, x, memory_budget=...)`` timed from a new
process (capture, profile, frontier and plan; this machine's timings cached first), for
ResNet-50, ViT-B/16 and BERT-base (transformers' default config, ``--side`` tokens), at ``"min"``,
half way from its predicted whole-step heap to plain autograd's, and ``"auto"``. Target: 10 s.

The machine is shared: wall seconds stretch with other jobs (the load average is in the JSON).

    python benchmarks/ready.py --json > benchmarks/data/ready_resnet50_vit_b16_4x128.json
    python benchmarks/ready.py --models resnet50 --measured-rounds 0
    python benchmarks/ready.py --ready --json > benchmarks/data/checkpointed_ready_4x128.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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
READY_MODELS = ("resnet50", "vit_b_16", "bert-base")


def _model(name: str, batch: int, side: int) -> tuple[torch.nn.Module, Any]:
    """torchvision's ``name`` for images of ``side``², or ``bert-base``: transformers' BERT-base
    (its default config, eager attention, 3 classes) on ``side`` tokens with an attention mask
    and labels."""
    torch.manual_seed(0)
    if name == "bert-base":
        tr = thirdparty.transformers()
        config = tr.BertConfig(num_labels=3, attn_implementation="eager")
        ids = torch.randint(0, config.vocab_size, (batch, side))
        mask = torch.ones(batch, side, dtype=torch.long)
        mask[-1, -2:] = 0
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (batch,))}
        return tr.BertForSequenceClassification(config), inputs
    tv = thirdparty.torchvision()
    kwargs = {"image_size": side} if name.startswith("vit") else {}
    return getattr(tv.models, name)(**kwargs), torch.randn(batch, 3, side, side)


def ready_child(name: str, budget: str, batch: int, side: int) -> None:
    """In a new process (the per-machine timings cached beforehand): the seconds
    ``Checkpointed(model, x, memory_budget=budget)`` takes, printed as one JSON line."""
    from edgetrain.runtime.checkpointed import Checkpointed

    torch.set_num_threads(1)
    model, x = _model(name, batch, side)
    wall, cpu = time.perf_counter(), time.process_time()
    memory: Any = int(budget) if budget.isdigit() else budget
    net = Checkpointed(model, x, memory_budget=memory)
    row = {
        "ready_s": time.perf_counter() - wall,
        "ready_cpu_s": time.process_time() - cpu,
        "stages": net.chain.length,
        "runs_as": net.runs_as,
        # The whole step's heap (tensors and kernel scratch), as budgets count it.
        "predicted_MB": (net.fixed_bytes + net.cost.heap_peak_bytes) / 1e6,
        "plain_MB": (net.fixed_bytes + net.plain_cost.heap_peak_bytes) / 1e6,
        "rho": net.predicted_recompute_factor,
    }
    print(json.dumps(row))


def _ready_in_new_process(name: str, budget: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--ready-child", name, budget]
    command += ["--batch", str(args.batch), "--side", str(args.side)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    row: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return row


def ready_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``Checkpointed`` ready, each in a new process: at ``"min"``, half way from its predicted
    peak to plain autograd's (a budget in bytes; both whole-step heap peaks: tensors and kernel
    scratch, what a budget holds) and at ``"auto"``."""
    rows = []
    for name in args.ready:
        least = _ready_in_new_process(name, "min", args)
        half = int(1e6 * (least["predicted_MB"] + least["plain_MB"]) / 2)
        for label, budget in (("min", least), ("half way", None), ("auto", None)):
            row = budget or _ready_in_new_process(
                name, str(half) if label == "half way" else label, args
            )
            size = f"{args.side} tokens" if name == "bert-base" else f"{args.side}²"
            rows.append({"model": f"{name} b{args.batch} {size}", "memory_budget": label, **row})
    return rows


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
    parser.add_argument(
        "--ready",
        nargs="*",
        default=None,
        help=f"time Checkpointed ready (default models: "
        f"{', '.join(READY_MODELS)}) instead of the profiles",
    )
    parser.add_argument("--ready-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ready_child:
        ready_child(*args.ready_child, args.batch, args.side)
        return
    if args.ready is not None:
        args.ready = args.ready or list(READY_MODELS)
        device_speed()  # cached for this machine before any new process is timed
        columns = ["model", "memory_budget", "stages", "runs_as", "predicted_MB", "plain_MB"]
        columns += ["rho", "ready_s", "ready_cpu_s"]
        extra = {"torch_threads": 1, "load_average": os.getloadavg(), "target_s": 10.0}
        emit(
            "Checkpointed ready, each in a new process", columns, ready_rows(args), args.json, extra
        )
        return
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
