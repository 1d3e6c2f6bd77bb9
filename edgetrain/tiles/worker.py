"""A worker: one rank training its tiles for a few steps, and the ``torchrun`` entry point (torch).

A training step on a rank: read the image region of its first group from the data (every board
holds the data set), run its tile through every group (:class:`TiledNetwork`), compute the loss
on its own tile of the output, back-propagate through its local graph (gradient halos flow to
the neighbours), all-reduce (sum) the weight gradients, and apply the same SGD update as every
other rank — so weights stay identical without any coordinator.

The loss is the mean squared error against a target map: a sum over output positions divided by
the number of elements, so each rank's share over its tile adds up (all-reduce) to the loss of
the whole batch. YOLOv2's region loss is likewise a sum over grid cells; a loss that is not
(one needing the whole map) would need an all-gather of the output and a replicated tail.

Run across boards with torchrun (one process per board)::

    torchrun --nnodes 4 --nproc-per-node 1 --node-rank K --master-addr 192.168.1.10 \\
        --master-port 29500 -m edgetrain.tiles.worker --model yolov2-16 --grid 2x2 \\
        --image 416 --groups auto --steps 10 --bind 192.168.1.1K
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import pickle
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edgetrain.autograd.heap import HeapPeak
from edgetrain.autograd.storage_counter import StorageCounter, resident_tensor_bytes
from edgetrain.tiles.comm import Comm, listening_addresses
from edgetrain.tiles.grid import Grid, Grouping
from edgetrain.tiles.layers import describe
from edgetrain.tiles.lifeline import die_with_parent
from edgetrain.tiles.step_start import StepStart
from edgetrain.tiles.sync import GradientSync, LossTotal
from edgetrain.tiles.tiled import TiledNetwork
from edgetrain.tiles.tiling import Network, Region, TilePlan, plan, region_slices

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class TileJob:
    """Training steps to run on every rank of a ``grid``.

    Attributes:
        model: the model with its initial weights (every rank gets the same copy).
        image: ``(height, width)`` of the synthetic images, in pixels.
        batch: images per step.
        grid: the tile grid; its size is the number of ranks.
        grouping: the fused layer groups.
        steps: training steps.
        dtype: ``"float32"`` or ``"float64"``.
        seed: seed of the synthetic data.
        lr: SGD learning rate.
        collect: return the last step's output tile, input gradient, weight gradients and the
            final weights (for :mod:`edgetrain.tiles.check`).
        fault: testing only: ``(kind, rank, step)`` makes that rank ``"die"`` (SIGKILL),
            ``"hang"`` or ``"raise"`` at the start of that step.
        reference: every rank trains the whole, untiled model on its own (no communication
            but a barrier before each step): the single-process baseline on a 1x1 grid, and on
            larger grids that many independent copies at once (the machine's parallel ceiling).
        measure_memory: count live tensor storages for ``peak_bytes`` (a dispatch mode; its
            first use imports about a second's worth of torch modules) and, with
            ``sample_heap``, sample the process heap for ``heap_peak_bytes`` (glibc's
            ``mallinfo2``: tensors and kernel scratch). The sampler is a thread calling
            ``mallinfo2`` without pause, which holds the allocator's lock while it walks the
            heap: every allocation of the step waits on it, the longer the more fragmented a
            long-lived process's heap is, so a step whose heap nobody reads (a prediction's dry
            step) runs without it; with ``sample_heap`` too, ``resident_bytes`` counts the
            tensors the process holds before its last step.
        cut: None for a plain chain of windows (``model`` an ``nn.Sequential``, fused groups);
            else ``model`` is any module torch.fx captures and its operations before ``cut`` run
            on tiles (:mod:`edgetrain.tiles.graph`; ``grouping`` is unused).
        first_step: the step to start from (a run resumed after a board dropped out): steps
            ``first_step .. steps - 1`` run, each on that step's data.
        recompute: per rank, the units it recomputes in backward instead of storing
            (:mod:`edgetrain.tiles.rankplan`: layers of a chain model, the first operation of
            a graph model's stretch); empty: every rank stores everything.
    """

    model: nn.Module
    image: tuple[int, int]
    batch: int
    grid: Grid
    grouping: Grouping
    steps: int = 1
    dtype: str = "float32"
    seed: int = 0
    lr: float = 0.01
    collect: bool = False
    fault: tuple[str, int, int] | None = None
    reference: bool = False
    measure_memory: bool = True
    cut: int | None = None
    first_step: int = 0
    recompute: tuple[frozenset[int], ...] = ()
    sample_heap: bool = True

    def recomputed(self, rank: int) -> frozenset[int]:
        """The units ``rank`` recomputes."""
        return self.recompute[rank] if self.recompute else frozenset()

    @property
    def channels(self) -> int:
        first = next(m for m in self.model.modules() if isinstance(m, nn.Conv2d))
        return first.in_channels

    def network(self) -> Network:
        """The chain model's geometry on this job's images; InvalidInput if they or the batch do not
        fit it (the same sizes and batches the untiled model accepts)."""
        assert isinstance(self.model, nn.Sequential)
        net = describe(self.model, self.channels, *self.image)
        net.check_batch(self.batch)
        return net

    def plan(self) -> TilePlan:
        return plan(self.network(), self.grid, self.grouping)


@dataclass
class RankResult:
    """What one rank measured (and, with ``collect``, returned) for one job.

    Tensors travel as numpy arrays so that they pickle by value between processes.
    """

    rank: int
    step_seconds: list[float]
    peak_bytes: int
    heap_peak_bytes: int | None  # the process heap's sampled peak above a step's start
    resident_bytes: int | None  # every tensor the process holds before its last step
    halo_bytes: int
    halo_messages: int
    collective_bytes: int
    sync_points: int
    wait_seconds: float
    losses: list[float]
    listening: list[str]
    output_region: Region
    input_region: Region
    checksum: float
    output: np.ndarray | None = None
    input_grad: np.ndarray | None = None
    grads: dict[str, np.ndarray] = field(default_factory=dict)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    recoveries: list[str] = field(default_factory=list)  # one line per board that dropped out

    @property
    def bytes_sent(self) -> int:
        """Halo bytes plus this rank's collective payload."""
        return self.halo_bytes + self.collective_bytes

    @property
    def median_step_seconds(self) -> float:
        # the first step pays for allocation and warm-up; leave it out when there are others
        times = self.step_seconds[1:] or self.step_seconds
        return statistics.median(times)

    def summary(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "peak_bytes": self.peak_bytes,
            "step_seconds": self.median_step_seconds,
            "bytes_sent": self.bytes_sent,
            "halo_bytes": self.halo_bytes,
            "collective_bytes": self.collective_bytes,
            "loss": self.losses[-1] if self.losses else None,
        }


def synthetic_batch(
    step: int,
    seed: int,
    batch: int,
    channels: int,
    image: tuple[int, int],
    output: tuple[int, ...],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (image, target) on every rank and in the single-process reference."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(batch, channels, *image, generator=generator, dtype=torch.float64)
    y = torch.randn(batch, *output, generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def squared_error(out: torch.Tensor, target: torch.Tensor, count: int) -> torch.Tensor:
    """Sum of squared errors over ``out``'s positions divided by the whole map's ``count``."""
    return (out - target).square().sum() / count


def sgd_step(parameters: list[nn.Parameter], lr: float) -> None:
    """Plain SGD, ``p -= lr * grad``: the same arithmetic on every rank and in the reference."""
    with torch.no_grad():
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.add_(parameter.grad, alpha=-lr)


def _inject(fault: tuple[str, int, int] | None, rank: int, step: int) -> None:
    if fault is None or fault[1] != rank or fault[2] != step:
        return
    if fault[0] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault[0] == "hang":
        time.sleep(3600)
    raise RuntimeError(f"injected fault on rank {rank} at step {step}")


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


class ChainStep:
    """Forward and loss of a plain chain of windows: fused groups (:class:`TiledNetwork`) on
    rank ``comm.rank``, or the whole model in this process (``reference``)."""

    def __init__(self, model: nn.Module, job: TileJob, comm: Comm, reference: bool) -> None:
        net = job.network()
        out_h, out_w = net.sizes[-1]
        self.out_shape = (job.batch, net.layers[-1].out_channels, out_h, out_w)
        self.comm = comm
        self.model: nn.Module | TiledNetwork = model
        if reference:
            self.input_region = Region(0, job.image[0], 0, job.image[1])
            self.output_region = Region(0, out_h, 0, out_w)
        else:
            assert isinstance(model, nn.Sequential)
            tiles = plan(net, job.grid, job.grouping)
            tiled = TiledNetwork(model, tiles, comm, job.recomputed(comm.rank))
            self.model = tiled
            self.input_region, self.output_region = tiled.input_region, tiled.output_region

    def forward(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        return self.model(x)  # type: ignore[no-any-return]

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, LossTotal]:
        share = squared_error(out, target[region_slices(self.output_region)], target.numel())
        return share, LossTotal.summed(share, self.comm)


def _step_for(job: TileJob, model: nn.Module, comm: Comm, dtype: torch.dtype) -> Any:
    if job.cut is None:
        return ChainStep(model, job, comm, job.reference)
    from edgetrain.tiles.graphjob import GraphStep

    sample = torch.zeros(job.batch, job.channels, *job.image, dtype=dtype)
    recompute = job.recomputed(comm.rank)
    return GraphStep(model, sample, job.grid, job.cut, comm, job.reference, recompute)


def run_job(
    job: TileJob,
    comm: Comm,
    progress: Any = None,
    model: nn.Module | None = None,
    start: StepStart | None = None,
) -> RankResult:
    """Run ``job``'s training steps as rank ``comm.rank``.

    ``progress(step)`` is called after each completed step. ``model`` (already in the job's
    dtype) is trained in place instead of a private copy of ``job.model``. ``start`` holds, when
    a step fails, what running it again needs (:class:`StepStart`).
    """
    if model is None:
        # A private copy: a model handed to a spawned process shares its storages with the
        # parent (torch pickles tensors through shared memory); every rank updates its own.
        model = copy.deepcopy(job.model).to(DTYPES[job.dtype])
    dtype = DTYPES[job.dtype]
    model.train()
    clock = comm  # steps start together on every rank
    if job.reference:
        comm = Comm.solo()  # every rank trains the whole model alone
    runner = _step_for(job, model, comm, dtype)
    in_region, out_region = runner.input_region, runner.output_region
    sync = GradientSync(list(model.parameters()), comm)
    try:
        regions = (in_region, out_region)
        start = start if start is not None else StepStart()
        return _train(job, comm, clock, model, runner, sync, regions, progress, start)
    finally:
        sync.remove()  # a failed step leaves no hook behind on a model trained further


def _train(
    job: TileJob,
    comm: Comm,
    clock: Comm,
    model: nn.Module,
    runner: Any,
    sync: GradientSync,
    regions: tuple[Region, Region],
    progress: Any,
    start: StepStart,
) -> RankResult:
    dtype = DTYPES[job.dtype]
    in_region = regions[0]
    parameters = sync.parameters
    before = copy.copy(comm.traffic)
    seen = _Seen()
    sampled = job.measure_memory and job.sample_heap
    for step in range(job.first_step, job.steps):
        _inject(job.fault, clock.rank, step)
        for parameter in parameters:
            parameter.grad = None
        start.buffers = None  # the last step's copy goes before this step's is made
        if sampled and step == job.steps - 1:
            seen.resident = resident_tensor_bytes()
        clock.barrier()  # start together, so a step's time is not another rank's lag
        meter = StorageCounter() if job.measure_memory else contextlib.nullcontext()
        sampler = HeapPeak() if sampled else contextlib.nullcontext()
        with sampler, meter:
            # Inside the count: a board holds its step's data and the copy of its buffers too.
            start.step = step
            start.buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
            image, target = synthetic_batch(
                step, job.seed, job.batch, job.channels, job.image, runner.out_shape[1:], dtype
            )
            began = time.perf_counter()
            x = image[region_slices(in_region)].contiguous()
            del image
            if job.collect:
                x.requires_grad_()
            out = runner.forward(x, job.seed * 1_000_003 + step)
            loss, total = runner.loss(out, target)
            sync.add(total.work)  # the loss's all-reduce runs during backward too
            loss.backward()
            sync.wait()  # the weight-gradient all-reduce, started during backward
            sgd_step(parameters, job.lr)
        seen.times.append(time.perf_counter() - began)
        if isinstance(meter, StorageCounter):
            seen.peak = max(seen.peak, meter.peak_bytes)
        if isinstance(sampler, HeapPeak) and sampler.peak_bytes is not None:
            seen.heaps.append(sampler.peak_bytes)
        seen.losses.append(float(total))
        del total
        if job.collect and step == job.steps - 1:
            seen.output = _numpy(out)
            seen.input_grad = _numpy(x.grad) if x.grad is not None else None
        del out, loss, x, target
        if progress is not None:
            progress(step)
    sync.close()
    return _result(job, comm, clock, model, regions, before, seen)


@dataclass
class _Seen:
    """What a rank's steps measured, as they run."""

    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peak: int = 0
    heaps: list[int] = field(default_factory=list)
    resident: int | None = None
    output: np.ndarray | None = None
    input_grad: np.ndarray | None = None


def _result(
    job: TileJob,
    comm: Comm,
    clock: Comm,
    model: nn.Module,
    regions: tuple[Region, Region],
    before: Any,
    seen: _Seen,
) -> RankResult:
    heaps = seen.heaps
    result = RankResult(
        rank=clock.rank,
        step_seconds=seen.times,
        peak_bytes=seen.peak,
        # The first step also keeps what lasts (imports, kernels' caches, the transport's
        # buffers): the steps after it, when there are others.
        heap_peak_bytes=max(heaps[1:] or heaps) if heaps else None,
        resident_bytes=seen.resident,
        halo_bytes=comm.traffic.halo_bytes - before.halo_bytes,
        halo_messages=comm.traffic.halo_messages - before.halo_messages,
        collective_bytes=comm.traffic.collective_bytes - before.collective_bytes,
        sync_points=comm.traffic.sync_points - before.sync_points,
        wait_seconds=comm.traffic.wait_seconds - before.wait_seconds,
        losses=seen.losses,
        listening=listening_addresses(),
        output_region=regions[1],
        input_region=regions[0],
        checksum=float(sum(p.double().sum().item() for p in model.state_dict().values())),
        output=seen.output,
        input_grad=seen.input_grad,
    )
    if job.collect and clock.rank == 0:
        result.grads = {
            n: _numpy(p.grad) for n, p in model.named_parameters() if p.grad is not None
        }
        result.state = {n: _numpy(t) for n, t in model.state_dict().items()}
    return result


def pin_cores(rank: int, world: int, threads: int) -> None:
    """Give each local worker its own cores when there are enough (Linux): a rank that migrates
    between cores makes every other rank wait for it at the next exchange."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cores and world * threads <= len(cores):
        os.sched_setaffinity(0, set(cores[rank * threads : (rank + 1) * threads]))


def serve(
    rank: int,
    world: int,
    store_path: str,
    address: str,
    timeout_seconds: float,
    threads: int,
    jobs_path: str,
    queue: Any,
    parent_pid: int | None = None,
) -> None:
    """Process entry of a local worker: run the pickled jobs and report on ``queue``.

    ``jobs_path`` holds ``pickle.dumps(list_of_jobs)``, written by the launcher (our parent
    process) into its private temporary directory. With ``parent_pid`` (the launcher's pid) the
    worker dies with the launcher (:func:`~edgetrain.tiles.lifeline.die_with_parent`).
    """

    def work(jobs: list[TileJob]) -> None:
        if world > 1:
            comm = Comm.from_file(store_path, rank, world, address, timeout_seconds)
        else:
            comm = Comm.solo()
        queue.put(("ready", rank, None, listening_addresses()))
        for index, job in enumerate(jobs):
            model = own_model(job, jobs[index + 1 :])
            progress = functools.partial(_report_step, queue, rank, index)
            result = run_job(job, comm, progress, model=model)
            del model  # the next job's weights are its own
            queue.put(("result", rank, index, result))

    run_worker(rank, world, threads, jobs_path, queue, parent_pid, work)


def _report_step(queue: Any, rank: int, index: int, step: int) -> None:
    queue.put(("step", rank, index, step))


def own_model(job: TileJob, later: list[TileJob]) -> nn.Module | None:
    """``job``'s model to train in place in a worker, which unpickled it for itself, so that a
    board holds its weights once; None (a private copy) when a later job starts from the same
    model."""
    if any(other.model is job.model for other in later):
        return None
    return job.model.to(DTYPES[job.dtype])


def run_worker(
    rank: int,
    world: int,
    threads: int,
    jobs_path: str,
    queue: Any,
    parent_pid: int | None,
    work: Any,
) -> None:
    """A local worker process's life around ``work(jobs)``: die with the launcher, its threads
    and cores, the pickled jobs loaded, then ``done`` on ``queue``, or the error's first line
    and exit status 1 (the launcher stops the others)."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    try:
        torch.set_num_threads(threads)
        pin_cores(rank, world, threads)
        payload = Path(jobs_path).read_bytes()
        if b"torchvision" in payload:  # its classes load only through edgetrain's importer
            from edgetrain.models import thirdparty

            thirdparty.torchvision()
        work(pickle.loads(payload))
        queue.put(("done", rank, None, None))
        queue.close()
        queue.join_thread()
    except BaseException as exc:  # report, then leave: the launcher stops the others
        lines = str(exc).strip().splitlines() or [""]
        queue.put(("error", rank, None, f"{type(exc).__name__}: {lines[0][:300]}"))
        queue.close()
        queue.join_thread()
        os._exit(1)


# --- torchrun ------------------------------------------------------------------------------


def _torchrun_job(
    model: nn.Module, name: str, image: tuple[int, int], grid: Grid, args: Any
) -> TileJob:
    """The job of ``name``: fused groups for a plain chain, else its graph cut by the cost
    model; with a profile of boards that differ, its tiles sized for them."""
    from edgetrain.devices import load
    from edgetrain.tiles.boardcost import balanced_job

    cluster = load(args.profile)
    job = _equal_job(model, name, image, grid, args, cluster)
    return balanced_job(job, cluster) if cluster.boards else job


def _equal_job(
    model: nn.Module, name: str, image: tuple[int, int], grid: Grid, args: Any, cluster: Any
) -> TileJob:
    from edgetrain.tiles.grouping import choose_grouping
    from edgetrain.tiles.supported import CHAIN_MODELS

    dtype = DTYPES[args.dtype]
    if name not in CHAIN_MODELS:
        from edgetrain.tiles.graph import analyse, choose_cut

        sample = torch.zeros(args.batch, 3, *image, dtype=dtype)
        graph, infos = analyse(model.to(dtype), sample)
        cut = choose_cut(graph, infos, grid, cluster)[0].cut
        return TileJob(
            model, image, args.batch, grid, (), args.steps, args.dtype, args.seed, cut=cut
        )
    net = describe(model, 3, *image)
    net.check_batch(args.batch)
    element = torch.finfo(dtype).bits // 8
    grouping = choose_grouping(args.groups, net, grid, cluster, args.batch, element)
    return TileJob(model, image, args.batch, grid, grouping, args.steps, args.dtype, args.seed)


def main(argv: list[str] | None = None) -> int:
    """``python -m edgetrain.tiles.worker``: one rank started by ``torchrun``.

    Rank 0 prints one JSON document with every rank's measurements.
    """
    from edgetrain.errors import EdgetrainError
    from edgetrain.models import build
    from edgetrain.tiles.grid import format_grouping, parse_grid, parse_image
    from edgetrain.tiles.supported import TILE_MODELS, tile_model

    parser = argparse.ArgumentParser(prog="python -m edgetrain.tiles.worker")
    parser.add_argument("--model", default="yolov2-16", help=f"one of {', '.join(TILE_MODELS)}")
    parser.add_argument("--grid", default="2x2")
    parser.add_argument("--image", default="416", help="416, or height x width (480x640)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--groups", default="auto")
    parser.add_argument("--profile", default="pi3-ethernet")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per operation")
    parser.add_argument("--bind", default=None, help="address gloo binds to (default: gloo's)")
    args = parser.parse_args(argv)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        image = parse_image(args.image)
        grid = parse_grid(args.grid)
        name = tile_model(args.model)
        comm, store = Comm.from_torchrun(args.bind, args.timeout)
        if grid.size != comm.size:
            raise EdgetrainError(
                f"grid {grid} needs {grid.size} ranks but torchrun started {comm.size}; "
                "make --nnodes x --nproc-per-node equal rows x columns"
            )
        torch.manual_seed(args.seed)
        model = build(name)
        for tensor in model.state_dict().values():  # every board starts from rank 0's weights
            comm.broadcast_(tensor)
        job = _torchrun_job(model, name, image, grid, args)
        result = run_job(job, comm)
        store.set(f"edgetrain/result/{comm.rank}", json.dumps(result.summary()))
        if comm.rank == 0:
            ranks = [json.loads(store.get(f"edgetrain/result/{r}")) for r in range(comm.size)]
            where = {"cut": job.cut} if job.cut is not None else {}
            doc = {"grid": job.grid.describe(), "groups": format_grouping(job.grouping), **where}
            doc["ranks"] = ranks
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        comm.barrier()
    except EdgetrainError as exc:
        sys.stderr.write(f"edgetrain: error: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
