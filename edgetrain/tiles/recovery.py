"""Keep training when a board drops out: survivors re-tile and repeat the lost step (torch).

Every rank holds the whole model's weights (they are replicated: each step all-reduces the weight
gradients and applies the same update everywhere), so the survivors of a lost board need nothing
from disk, and none holds a second copy of them. A step changes the weights only in its last act,
the update, so a rank whose step failed still holds the weights of that step's start; it keeps
a copy of its buffers as the step began (batch norms update theirs in the forward pass), which
the step's own memory count includes. When a step fails (gloo reports a killed peer's closed
connection at once, a hung peer after the operation timeout), the worker tells the launcher how
many steps it completed and why it stopped, and waits for the launcher's decision. The launcher,
which sees every process, judges: a step that failed with every peer alive failed on its own
and stops the run (the same step would fail again); otherwise the workers still running that
reported in survive, one that neither reported nor died within two operation timeouts is
stopped as hung, the survivors' job is planned again (:data:`Replan`: ``edgetrain tiles`` plans
them as it planned its start, on the grid :func:`survivor_grid` proposes), and they resume at
the most steps a survivor completed. Survivors can differ by one: a step completes on a rank
once its gradient all-reduce has, which may happen on some ranks and not on others when a peer
dies during it; the all-reduce that completed summed every rank's gradients, so that rank holds
the weights of a run that lost no board. Each survivor puts back its buffers of its step's start
and joins a new gloo group of the survivors (a new file store, the same bound address); when
they differ, every survivor takes the weights and buffers of one that completed the most (a
broadcast, received whole before any is replaced); the interrupted step runs again, on the new
tiling, with the same data.

The decision (the survivors, the step, the survivor whose weights all take, and their layout:
grid and shares, grouping or cut, each rank's recomputation) travels as a small JSON file in
the launcher's private directory, written atomically. The launcher is the one arbiter: the
workers never need to agree among themselves with a peer gone, and a board that is merely slow
cannot split the run in two. A board that joins later is not taken in.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from edgetrain.errors import InvalidInput
from edgetrain.tiles.comm import Comm, is_peer_loss, listening_addresses
from edgetrain.tiles.grid import Grid, Grouping
from edgetrain.tiles.step_start import StepStart
from edgetrain.tiles.tiling import plan
from edgetrain.tiles.worker import TileJob, own_model, run_job, run_worker

DECISION_WAIT_FACTOR = 3.0
"""A worker waits this many operation timeouts (plus a minute) for the launcher's decision."""


Replan = Callable[[tuple[int, ...], Grid], TileJob]
"""How a launch plans its boards, called again for the survivors: given the launch ranks that
continue (in their new rank order) and the grid :func:`survivor_grid` proposes, the job they run
(its grid, grouping or cut and each rank's recomputation; the grid may be another of as many
tiles). An :class:`~edgetrain.errors.EdgetrainError` says the survivors cannot continue."""


@dataclass(frozen=True)
class Decision:
    """Who continues after a board dropped out, from which step, and how their work is laid out:
    the grid (with its shares), the grouping or cut and each new rank's recomputation."""

    generation: int
    members: tuple[int, ...]  # the launch's ranks that continue, in their new rank order
    grid: Grid
    resume_step: int
    grouping: Grouping = ()
    cut: int | None = None
    recompute: tuple[frozenset[int], ...] = ()
    source: int | None = None  # the new rank whose weights all take; None: all hold them

    @staticmethod
    def of(
        generation: int,
        members: tuple[int, ...],
        job: TileJob,
        resume: int,
        source: int | None = None,
    ) -> Decision:
        """The decision that runs ``job``'s layout on ``members`` from step ``resume``, every
        member taking the weights of new rank ``source`` first (when one is given)."""
        layout = (job.grid, resume, job.grouping, job.cut, job.recompute, source)
        return Decision(generation, members, *layout)

    def applied(self, job: TileJob) -> TileJob:
        """``job`` laid out as decided, from the resumed step."""
        return replace(
            job,
            grid=self.grid,
            grouping=self.grouping,
            cut=self.cut,
            recompute=self.recompute,
            first_step=self.resume_step,
        )

    def to_json(self) -> str:
        grid = self.grid
        return json.dumps(
            {
                "generation": self.generation,
                "members": list(self.members),
                "grid": [grid.rows, grid.cols, list(grid.row_shares), list(grid.col_shares)],
                "resume_step": self.resume_step,
                "grouping": [list(g) for g in self.grouping],
                "cut": self.cut,
                "recompute": [sorted(units) for units in self.recompute],
                "source": self.source,
            }
        )

    @staticmethod
    def from_json(text: str) -> Decision:
        doc = json.loads(text)
        rows, cols, row_shares, col_shares = doc["grid"]
        return Decision(
            int(doc["generation"]),
            tuple(int(m) for m in doc["members"]),
            Grid(int(rows), int(cols), tuple(row_shares), tuple(col_shares)),
            int(doc["resume_step"]),
            tuple((int(a), int(b)) for a, b in doc["grouping"]),
            None if doc["cut"] is None else int(doc["cut"]),
            tuple(frozenset(int(u) for u in units) for units in doc["recompute"]),
            None if doc["source"] is None else int(doc["source"]),
        )


def decision_path(directory: str, generation: int) -> Path:
    return Path(directory) / f"decision.{generation}.json"


def store_path(directory: str, generation: int) -> str:
    return str(Path(directory) / f"store.{generation}")


def write_decision(directory: str, decision: Decision) -> None:
    """Write atomically: a worker polling for the file never reads half of it."""
    final = decision_path(directory, decision.generation)
    temporary = final.with_suffix(".tmp")
    with open(temporary, "w") as handle:
        handle.write(decision.to_json())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, final)


def survivor_grid(job: TileJob, survivors: int) -> Grid:
    """The grid ``survivors`` boards tile ``job``'s model on: the factorisation of ``survivors``
    closest in shape to the job's grid whose tiling plans (a 1x1 grid always does; a captured
    graph's placement keeps maps too small for a grid whole, so any grid plans)."""
    shape = job.grid.rows / job.grid.cols
    candidates = sorted(
        (
            Grid(rows, survivors // rows)
            for rows in range(1, survivors + 1)
            if survivors % rows == 0
        ),
        key=lambda g: abs((g.rows / g.cols) - shape),
    )
    if job.cut is not None:  # a captured graph places every map on any grid it fits
        return candidates[0]
    network = job.network()
    for grid in candidates:
        try:
            plan(network, grid, job.grouping)
        except InvalidInput:
            continue
        return grid
    raise InvalidInput(
        f"no grid of {survivors} boards tiles this model at {job.image[0]}x{job.image[1]}; "
        "the run cannot continue on them"
    )


def kept_plan(job: TileJob) -> Replan:
    """The survivors' job when nothing plans them (a launch from Python without a planner): the
    grid :func:`survivor_grid` proposes, ``job``'s grouping or cut, and every survivor
    recomputing each unit any rank of ``job`` recomputed (their tiles are larger).
    ``edgetrain tiles`` plans them as it plans its start instead."""

    def plan_for(members: tuple[int, ...], grid: Grid) -> TileJob:
        recompute = (frozenset().union(*job.recompute),) * grid.size if job.recompute else ()
        return replace(job, grid=grid, recompute=recompute)

    return plan_for


def _await_decision(directory: str, generation: int, deadline_seconds: float) -> Decision:
    path = decision_path(directory, generation)
    deadline = time.monotonic() + deadline_seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no decision from the launcher in {deadline_seconds:.0f} s")
        time.sleep(0.05)
    return Decision.from_json(path.read_text())


def serve_recovering(
    rank: int,
    world: int,
    directory: str,
    address: str,
    timeout_seconds: float,
    threads: int,
    jobs_path: str,
    queue: Any,
    parent_pid: int | None = None,
) -> None:
    """Process entry of a local worker that survives the loss of its peers (one job).

    Messages on ``queue`` as :func:`~edgetrain.tiles.worker.serve` sends them, keyed by this
    worker's launch rank, plus ``("lost", rank, generation, (completed_steps, cause,
    peer_loss))`` when a step fails; the launcher decides whether a peer was lost (one died or
    hangs) or the step failed on its own (then the run stops).
    """

    def work(jobs: list[TileJob]) -> None:
        (job,) = jobs
        queue.put(("ready", rank, None, listening_addresses()))
        result = _train_recovering(rank, world, directory, address, timeout_seconds, job, queue)
        queue.put(("result", rank, 0, result))

    run_worker(rank, world, threads, jobs_path, queue, parent_pid, work)


def _train_recovering(
    rank: int,
    world: int,
    directory: str,
    address: str,
    timeout_seconds: float,
    job: TileJob,
    queue: Any,
) -> Any:
    model = own_model(job, [])  # unpickled for this worker: trained in place
    assert model is not None
    start = StepStart()  # the buffers as the step in progress began
    done = 0  # the steps completed: the weights are those at the start of step `done`
    decision = Decision.of(0, tuple(range(world)), job, 0)

    def completed(step: int) -> None:
        nonlocal done
        done = step + 1
        queue.put(("step", rank, 0, step))

    while True:
        size = len(decision.members)
        new_rank = decision.members.index(rank)
        path = store_path(directory, decision.generation)
        fault = job.fault if decision.generation == 0 else None
        this = replace(decision.applied(job), fault=fault)
        try:  # a peer lost while the group forms, or while the weights travel, is lost too
            comm = (
                Comm.from_file(path, new_rank, size, address, timeout_seconds)
                if size > 1
                else Comm.solo()
            )
            if decision.source is not None:
                take_state(comm, model, decision.source)
                done = decision.resume_step
            return run_job(this, comm, completed, model=model, start=start)
        except Exception as exc:  # the launcher judges: a lost peer, or this rank's own error
            cause = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
            queue.put(("lost", rank, decision.generation, (done, cause, is_peer_loss(exc))))
        wait = DECISION_WAIT_FACTOR * timeout_seconds + 60.0
        decision = _await_decision(directory, decision.generation + 1, wait)
        if rank not in decision.members:
            raise RuntimeError("left out of the survivors")
        start.rewind(model, done)


def take_state(comm: Comm, model: torch.nn.Module, source: int) -> None:
    """Every rank's weights and buffers become rank ``source``'s, all or nothing: they arrive
    in new tensors and replace the model's only once every one has (a peer lost meanwhile
    leaves the model as it was)."""
    state = model.state_dict()
    arrived = [comm.broadcast_(tensor.detach().clone(), source) for tensor in state.values()]
    with torch.no_grad():
        for tensor, value in zip(state.values(), arrived, strict=True):
            tensor.copy_(value)
