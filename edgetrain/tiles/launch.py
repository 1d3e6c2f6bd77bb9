"""Start local workers as processes, watch them, and stop them all if one fails (torch).

Workers meet through a file store in a temporary directory and bind their gloo sockets to the
given address (loopback by default): nothing listens on another interface. The launcher watches
every child: when one dies (a signal, an exception, an early exit), reports an error, or no rank
makes progress for ``progress_timeout`` seconds, the others are terminated (then killed) and
:class:`WorkerFailed` is raised with one line naming the rank and the cause. Surviving workers
blocked on the dead one fail by themselves too: every gloo operation has ``timeout`` seconds.

Workers die with the launcher: each asks for a SIGKILL when its parent exits and watches its
parent's pid (:mod:`edgetrain.tiles.lifeline`), so a launcher killed by SIGKILL leaves no
orphan; a SIGTERM to the launcher stops its workers and removes the temporary directory, then
exits with status 143. At most :data:`MAX_LOCAL_WORKERS` workers run on one machine.

Across boards use ``torchrun`` instead (see :mod:`edgetrain.tiles.worker` and
docs/tiles.md).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue as queues
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from edgetrain.errors import EdgetrainError, InvalidInput
from edgetrain.tiles.comm import is_peer_loss
from edgetrain.tiles.recovery import (
    Decision,
    Replan,
    kept_plan,
    serve_recovering,
    survivor_grid,
    write_decision,
)
from edgetrain.tiles.worker import RankResult, TileJob, serve

MAX_LOCAL_WORKERS = 16
"""Most workers (tiles) one local launch starts: each is a process that imports torch (about
200-300 MB of memory before any work), and more processes than a board has cores only queue."""


class WorkerFailed(EdgetrainError):
    """A worker died, failed or hung; the others were stopped."""


class SurvivorsCannotContinue(WorkerFailed):
    """Boards dropped out and the plan for the others failed (no grid of them fits their
    memory); every worker was stopped."""


def check_local_workers(world: int, grid: str = "") -> None:
    """InvalidInput when ``world`` workers (``grid``) exceed :data:`MAX_LOCAL_WORKERS`."""
    if world > MAX_LOCAL_WORKERS:
        raise InvalidInput(
            f"{f'grid {grid} needs ' if grid else ''}{world} local workers, more than the "
            f"{MAX_LOCAL_WORKERS} one machine runs; use a smaller grid, or torchrun across boards "
            "(docs/tiles.md)"
        )


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def run_local(
    jobs: Sequence[TileJob],
    *,
    address: str = "127.0.0.1",
    threads: int = 1,
    timeout: float = 120.0,
    progress_timeout: float | None = None,
    recover: bool = False,
    replan: Replan | None = None,
) -> list[list[RankResult]]:
    """Run ``jobs`` (same grid size) on local worker processes; results per job, per rank.

    ``timeout`` bounds every gloo operation in seconds; ``progress_timeout`` (default: twice
    ``timeout`` plus a minute for start-up) bounds the time between two steps of any rank.
    With ``recover`` (one job), a worker that dies or hangs does not stop the run: the others
    re-tile the model and repeat the interrupted step (:mod:`edgetrain.tiles.recovery`); the
    results are the survivors', in their final rank order, each listing the recoveries.
    ``replan`` plans the survivors' job (:data:`~edgetrain.tiles.recovery.Replan`: the way the
    launch planned its start, called again for them); without it they keep the job's layout on
    the grid :func:`~edgetrain.tiles.recovery.survivor_grid` proposes
    (:func:`~edgetrain.tiles.recovery.kept_plan`).
    """
    if not jobs:
        return []
    if recover and len(jobs) != 1:
        raise AssertionError("a recovering launch runs one job")
    world = jobs[0].grid.size
    if any(job.grid.size != world for job in jobs):
        raise AssertionError("all jobs of one launch need the same number of ranks")
    check_local_workers(world, str(jobs[0].grid))
    limit = progress_timeout if progress_timeout is not None else 2 * timeout + 60.0
    context = multiprocessing.get_context("spawn")
    inbox: Any = context.Queue()
    with tempfile.TemporaryDirectory(prefix="edgetrain-tiles-") as tmp:
        store = str(Path(tmp) / "store")
        # The jobs go through a file in our private directory, pickled by value: faster than
        # multiprocessing's shared-memory tensors for many children, no rank can touch another's
        # weights, and a child that dies before reading cannot block start() on a full pipe.
        blob = str(Path(tmp) / "jobs.pickle")
        Path(blob).write_bytes(pickle.dumps(list(jobs)))
        target, where = (serve_recovering, tmp) if recover else (serve, store)
        processes = [
            context.Process(
                target=target,
                args=(rank, world, where, address, timeout, threads, blob, inbox),
                kwargs={"parent_pid": os.getpid()},
                name=f"edgetrain-tile-{rank}",
                daemon=True,
            )
            for rank in range(world)
        ]
        with _exit_on_sigterm():
            try:
                for process in processes:
                    process.start()
                if recover:
                    plan_for = replan or kept_plan(jobs[0])
                    watcher = Survivors(jobs[0], processes, inbox, tmp, timeout, limit, plan_for)
                    return [watcher.watch()]
                return _watch(processes, inbox, len(jobs), limit)
            finally:
                _stop(processes)
                inbox.close()
                inbox.cancel_join_thread()


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """While the workers run, a SIGTERM raises SystemExit(143) so that they are stopped and the
    temporary directory removed; only in the main thread, and only where SIGTERM still has its
    default action (a handler the program installed is kept)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _watch(processes: list[Any], inbox: Any, jobs: int, limit: float) -> list[list[RankResult]]:
    world = len(processes)
    results: list[list[RankResult | None]] = [[None] * world for _ in range(jobs)]
    done: set[int] = set()
    errors: dict[int, str] = {}
    last_progress = time.monotonic()
    while len(done) < world:
        try:
            kind, rank, index, payload = inbox.get(timeout=0.1)
        except queues.Empty:
            kind = None
        if kind is not None:
            last_progress = time.monotonic()
            if kind == "result":
                results[index][rank] = payload
            elif kind == "done":
                done.add(rank)
            elif kind == "error":
                errors[rank] = payload
        dead = {
            rank: p.exitcode
            for rank, p in enumerate(processes)
            if p.exitcode is not None and rank not in done
        }
        if errors or any(code != 0 for code in dead.values()):
            _fail(processes, inbox, errors, dead)
        if dead and time.monotonic() - last_progress > 5.0:
            # exited cleanly without saying done (its last messages had 5 s to arrive)
            _fail(processes, inbox, errors, dead)
        if time.monotonic() - last_progress > limit:
            _stop(processes)
            raise WorkerFailed(
                f"no worker made progress for {limit:.0f} s (hung?); stopped all {world}; "
                "raise --timeout for very slow steps"
            )
    return [[r for r in per_job if r is not None] for per_job in results]


def _fail(processes: list[Any], inbox: Any, errors: dict[int, str], dead: dict[int, Any]) -> None:
    """Collect what else arrives for a moment, stop everyone, and raise the root cause."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            kind, rank, _, payload = inbox.get(timeout=0.1)
        except queues.Empty:
            continue
        if kind == "error":
            errors[rank] = payload
    for rank, p in enumerate(processes):
        if p.exitcode is not None and p.exitcode != 0:
            dead[rank] = p.exitcode
    _stop(processes)
    others = len(processes) - 1
    # A rank that died without a word is the cause; the others only lost their peer.
    silent = sorted(r for r, code in dead.items() if r not in errors and code != 0)
    if silent:
        rank = silent[0]
        raise WorkerFailed(
            f"worker rank {rank} {_describe_exit(dead[rank])}; stopped the other {others}"
        )
    if not errors:
        rank = min(dead) if dead else 0
        raise WorkerFailed(
            f"worker rank {rank} exited before finishing its steps; stopped the other {others}"
        )
    cause = _root_error(errors)
    if cause is not None:
        raise WorkerFailed(
            f"worker rank {cause} failed: {errors[cause]}; stopped the other {others}"
        )
    # Only lost or timed-out peers were reported: the ranks that said nothing are stuck.
    quiet = [r for r in range(len(processes)) if r not in errors]
    first = min(errors)
    raise WorkerFailed(
        f"worker rank {','.join(map(str, quiet)) or '?'} stopped responding (hung?); rank {first} "
        f"reported {errors[first]}; stopped all {len(processes)}"
    )


def _root_error(errors: dict[int, str]) -> int | None:
    """The first rank whose error is not just a lost or timed-out peer, if any."""
    for rank in sorted(errors):
        if not is_peer_loss(errors[rank]):
            return rank
    return None


def _stop(processes: list[Any]) -> None:
    """Terminate, then kill, the workers this launcher started."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(timeout=3.0)


def resume_point(completed: list[int]) -> tuple[int, int | None]:
    """The step survivors that completed ``completed`` steps each resume at, the most any
    completed (a rank completes a step once its gradient all-reduce has, which a peer lost
    during it can allow on some ranks and not others, so they differ by one at most; that
    all-reduce summed every rank's gradients), and the index of the survivor whose weights the
    others take, or None when they all completed as many."""
    resume = max(completed)
    return resume, (completed.index(resume) if min(completed) < resume else None)


class Survivors:
    """Watch a recovering launch: when workers die or hang, decide who continues, on which grid,
    from which step (see :mod:`edgetrain.tiles.recovery`)."""

    def __init__(
        self,
        job: TileJob,
        processes: list[Any],
        inbox: Any,
        directory: str,
        timeout: float,
        limit: float,
        replan: Replan,
    ) -> None:
        self.job, self.processes, self.inbox, self.replan = job, processes, inbox, replan
        self.directory, self.timeout, self.limit = directory, timeout, limit
        self.members = list(range(len(processes)))
        self.generation = 0
        self.results: dict[int, RankResult] = {}
        self.done: set[int] = set()
        self.lost: dict[int, tuple[int, str]] = {}  # rank -> (steps completed, cause)
        self.steps: dict[int, int] = {}  # rank -> last step completed
        self.lines: list[str] = []
        self.since: float | None = None  # when this generation first lost a peer
        self.last_progress = time.monotonic()
        self.seen: dict[int, float] = {}  # rank -> when its last message arrived
        self.own: dict[int, tuple[float, str]] = {}  # failures that do not read as a lost peer

    def watch(self) -> list[RankResult]:
        while not all(rank in self.done for rank in self.members):
            self._receive()
            dead = self._dead()
            if time.monotonic() - self.last_progress > self.limit and not self.lost:
                raise WorkerFailed(
                    f"no worker made progress for {self.limit:.0f} s (hung?); stopped all "
                    f"{len(self.members)}; raise --timeout for very slow steps"
                )
            self._fail_on_own_error(dead)
            if dead or self.lost:
                self.since = self.since if self.since is not None else time.monotonic()
                self._maybe_decide(dead)
        ordered = [self.results[rank] for rank in self.members]
        for result in ordered:
            result.recoveries = list(self.lines)
        return ordered

    def _receive(self) -> None:
        try:
            kind, rank, index, payload = self.inbox.get(timeout=0.1)
        except queues.Empty:
            return
        self.last_progress = self.seen[rank] = time.monotonic()
        if kind == "step":
            self.steps[rank] = payload
        elif kind == "result":
            self.results[rank] = payload
        elif kind == "done":
            self.done.add(rank)
        elif kind == "lost" and index == self.generation:
            done, cause, peer_loss = payload
            self.lost[rank] = (done, cause)
            if not peer_loss:
                self.own[rank] = (time.monotonic(), cause)
        elif kind == "error":
            _stop(self.processes)
            raise WorkerFailed(f"worker rank {rank} failed: {payload}; stopped all")

    def _dead(self) -> dict[int, int]:
        return {
            rank: self.processes[rank].exitcode
            for rank in self.members
            if self.processes[rank].exitcode is not None and rank not in self.done
        }

    def _fail_on_own_error(self, dead: dict[int, int]) -> None:
        """A step that failed with every peer alive a second later failed on its own (the same
        step would fail again): stop the run with its cause."""
        if dead:
            return
        for rank, (when, cause) in sorted(self.own.items()):
            if time.monotonic() - when > 1.0:
                _stop(self.processes)
                raise WorkerFailed(f"worker rank {rank} failed: {cause}; stopped all")

    def _deadline(self, rank: int) -> float:
        """When a worker that has not reported the loss counts as hung: two operation timeouts
        (one it may have begun just before the loss, one for a group it joins after it) after the
        later of the loss and its last message; a worker still starting (no message yet) gets as
        long as any step may take."""
        assert self.since is not None
        if rank not in self.seen:
            return self.since + self.limit
        return max(self.since, self.seen[rank]) + 2 * self.timeout + 10.0

    def _maybe_decide(self, dead: dict[int, int]) -> None:
        alive = [r for r in self.members if r not in dead]
        pending = [r for r in alive if r not in self.lost and r not in self.done]
        assert self.since is not None
        # A peer blocked on the lost one reports once its operation (or the group's rendezvous,
        # which it may join after the loss) times out.
        now = time.monotonic()
        hung = [r for r in pending if now > self._deadline(r)]
        if len(hung) < len(pending):
            return
        for rank in hung:  # neither finished nor noticed the loss: stopped as hung
            self.processes[rank].kill()
            self.processes[rank].join(timeout=3.0)
        survivors = [r for r in alive if r in self.lost]
        gone = sorted(set(dead) | set(hung))
        if not survivors:
            if all(r in self.done for r in alive):
                self.members = alive  # the others finished before the loss mattered
                return
            _stop(self.processes)
            causes = "; ".join(f"rank {r}: {c}" for r, (_, c) in sorted(self.lost.items()))
            raise WorkerFailed(
                f"every worker stopped ({', '.join(map(str, gone))}){'; ' if causes else ''}"
                f"{causes}"
            )
        resume, source = resume_point([self.lost[r][0] for r in survivors])
        how = "; ".join(
            f"board {r} {_describe_exit(dead[r]) if r in dead else 'stopped answering'}"
            for r in gone
        )
        self.job = self._plan(tuple(survivors), f"{how} during step {resume}")
        self.generation += 1
        decision = Decision.of(self.generation, tuple(survivors), self.job, resume, source)
        write_decision(self.directory, decision)
        again = f"repeat step {resume}" if resume else "start again from step 0"
        if source is not None:
            behind = ", ".join(str(r) for r in survivors if self.lost[r][0] < resume)
            again += f" (board {behind} takes board {survivors[source]}'s weights)"
        self.lines.append(
            f"{how} during step {resume}; {len(survivors)} continue on a "
            f"{self.job.grid.describe()} grid and {again}"
        )
        self.members, self.lost, self.own, self.since = survivors, {}, {}, None
        self.last_progress = time.monotonic()

    def _plan(self, survivors: tuple[int, ...], what: str) -> TileJob:
        """The survivors' job, planned like the start's; when it cannot be (no grid of them fits
        their memory), every worker is stopped and one line names the boards that remain."""
        try:
            return self.replan(survivors, survivor_grid(self.job, len(survivors)))
        except EdgetrainError as exc:
            _stop(self.processes)
            left = ", ".join(map(str, survivors))
            remain = f"boards {left} remain" if len(survivors) > 1 else f"board {left} remains"
            raise SurvivorsCannotContinue(f"{what}; {remain} and cannot continue: {exc}") from exc
