"""A POET plan that runs: the MILP's five matrices as a :class:`~edgetrain.core.schedule.Schedule`.

For a training graph made from a chain (:func:`edgetrain.planners.poet.graph.from_chain`: nodes
``F0 .. F(L-1)``,
``loss``, ``B(L-1) .. B0``) solved in the ``edgetrain`` accounting, :func:`schedule_from_plan`
turns ``R``, ``S_ram``, ``page_in``, ``page_out`` into operations of the one :class:`Op` set, in
the spirit of Checkmate's ``schedule_from_rs``: stage by stage, run what ``R`` says, free what no
later operation needs, and page what the MILP pages.

How a computation of a forward node ``F(j)`` in stage ``t`` becomes an operation:

* ``Fa j`` (forward with grad) when it is the *graph instance*: the last computation of ``F(j)`` at
  or before the stage of ``B(j)``, whose value the MILP keeps in RAM until ``B(j)`` reads it. The
  backward needs what autograd saved, which only a forward with grad builds, and builds once.
* otherwise ``Fc j`` when the input ``a[j]`` it read is read again later (a later computation of
  ``F(j)`` uses the same copy, or that copy is paged out afterwards), ``Fn j`` when this was the
  input's last use (``Fn`` and ``Fa`` drop our reference to ``a[j]`` as they finish).

Every value is a *copy* of an activation ``a[k] = F(k-1)``'s output: made by a forward or a page-in,
read by forwards of stage ``k``, ended by a discard or a page-out. A copy is freed right after its
last read (``Fn`` / ``Fa`` / ``D k``), not when the MILP drops it; a page-out ``Po k`` is placed
right after the last read of the copy the MILP pages (or after the backward of a graph that holds
that copy); a page-in ``Pi k`` right before the first read of the copy it makes (the MILP counts a
page-in's bytes from the start of its stage). So the schedule holds a subset of what the MILP
counts at every step, and its simulated peak is at most the MILP's ``edgetrain`` peak, except in
one corner: a page-out's bytes are held until the operation after it ends (the write overlaps
it), which may be the first operation of the next stage. :func:`check_against` (called by
:func:`plan_poet`) checks the simulated peak against the budget whatever happens.

Costs are the simulator's: the schedule's compute time is
:func:`~edgetrain.core.simulator.simulate`'s,
turned into device seconds and joules by :func:`device_cost` exactly as
:func:`~edgetrain.planners.poet.graph.from_chain` turns stages into nodes; a ``Po k``/``Pi k``
costs the device's
page-out/page-in of ``a[k]``'s bytes (what the executor writes: the activation, never a graph).
The number of each operation equals the MILP's count of the matching variable, so the schedule's
time and energy equal the MILP's objective and runtime (to rounding); :func:`check_against`
checks that they do.

``S_flash`` is not read: what is on flash follows from the page-outs and page-ins.

What cannot run, refused with :class:`~edgetrain.errors.InvalidSchedule` rather than run as
something else: a plan that pages a gradient (no operation does that), that feeds a backward from
a paged-in forward node (an executor cannot page a graph: it pages activations), that pages the
same page in twice (a page is read once and deleted) or writes a page before the last was read,
that computes a value again while a graph holds it (one copy of an activation at a time), or
anything else the simulator refuses, or whose time, energy or peak differ from the MILP's.
:func:`edgetrain.planners.poet.milp.solve` with ``runnable=True`` (what :func:`plan_poet` solves)
keeps
the MILP to plans that convert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Op, Schedule, made_for
from edgetrain.core.simulator import Cost, simulate
from edgetrain.devices.energy import EnergyProfile
from edgetrain.errors import InfeasibleBudget, InvalidInput, InvalidSchedule
from edgetrain.planners.poet import milp
from edgetrain.planners.poet.graph import TrainingGraph, from_chain
from edgetrain.units import parse_bytes

TOLERANCE = 1e-9
"""Relative tolerance between the schedule's time and energy and the MILP's (float rounding)."""


@dataclass(frozen=True)
class DeviceCost:
    """What a schedule costs on a device (serial: paging time is added to compute time).

    Attributes:
        seconds: compute seconds of every operation plus page-out and page-in seconds (s).
        compute_joules / pagein_joules / pageout_joules: the energy split (J).
    """

    seconds: float
    compute_joules: float
    pagein_joules: float
    pageout_joules: float

    @property
    def energy_joules(self) -> float:
        """Total energy (J)."""
        return self.compute_joules + self.pagein_joules + self.pageout_joules


def device_cost(
    chain: Chain,
    schedule: Schedule,
    device: EnergyProfile,
    *,
    chain_flops_per_second: float = 1e9,
) -> DeviceCost:
    """The schedule's time and energy on ``device``: each stage's seconds on the chain are turned
    into floating-point operations at ``chain_flops_per_second`` and then into the device's
    seconds and joules (as :func:`~edgetrain.planners.poet.graph.from_chain` does); ``Po k``/``Pi
    k`` cost the
    device's page-out/page-in of ``a[k]``'s bytes. Validates the schedule with
    :func:`~edgetrain.core.simulator.simulate` first."""
    simulate(chain, schedule)
    seconds = compute = page_in = page_out = 0.0
    for kind, k in schedule:
        if kind is Op.PAGE_OUT or kind is Op.PAGE_IN:
            size = chain.activation_bytes(k)
            if kind is Op.PAGE_OUT:
                seconds += device.pageout_seconds(size)
                page_out += device.pageout_joules(size)
            else:
                seconds += device.pagein_seconds(size)
                page_in += device.pagein_joules(size)
            continue
        if kind is Op.DISCARD:
            continue
        stage = chain.stages[k]
        flop = chain_flops_per_second * (
            stage.backward_seconds if kind is Op.BACKWARD else stage.forward_seconds
        )
        seconds += device.compute_seconds(flop)
        compute += device.compute_joules(flop)
    return DeviceCost(seconds, compute, page_in, page_out)


@dataclass
class _Copy:
    """One copy of ``a[k]`` in RAM: made by a forward or a page-in, read by forwards of stage k."""

    k: int
    made_at: int  # the compute operation that made it (a page-in: its stage's last one)
    paged_in: bool = False
    reads: list[int] = field(default_factory=list)
    paged_out: bool = False


def _refuse(why: str) -> InvalidSchedule:
    return InvalidSchedule(f"this MILP plan cannot run as a chain schedule: {why}")


def schedule_from_plan(
    chain: Chain, graph: TrainingGraph, plan: dict[str, np.ndarray], *, strategy: str = "poet"
) -> Schedule:
    """The :class:`Schedule` that runs ``plan`` (the MILP's matrices) on ``chain``.

    ``graph`` must be ``from_chain(chain, ...)``. Raises :class:`InvalidSchedule` when the plan
    cannot be run exactly (see the module docstring).
    """
    n = chain.length
    _check_made_from(chain, graph)
    r, s_ram, p_in, p_out = (
        np.rint(np.asarray(plan[key])).astype(np.int64)
        for key in ("R", "S_ram", "page_in", "page_out")
    )
    if (p_in[:, n:].any()) or (p_out[:, n:].any()):
        raise _refuse("it pages a gradient; only activations can be paged (solve with runnable)")
    graph_stage = _graph_stages(n, r, s_ram, p_in)
    compute, copies = _replay(n, graph_stage, r, s_ram, p_in, p_out)
    ops = _place(chain, compute, copies)
    schedule = Schedule.from_ops(n, ops, strategy, {})
    try:
        simulate(chain, schedule)
    except InvalidSchedule as exc:
        raise _refuse(str(exc)) from exc
    return schedule


def _check_made_from(chain: Chain, graph: TrainingGraph) -> None:
    """Raise :class:`InvalidInput` unless ``graph`` has the nodes of ``from_chain(chain)``."""
    n = chain.length
    if len(graph) != 2 * n + 1 or any(
        node.stage != (k if k < n else -1 if k == n else 2 * n - k)
        for k, node in enumerate(graph.nodes)
    ):
        raise InvalidInput(
            "the graph was not made from this chain; build it with "
            "edgetrain.planners.poet.graph.from_chain"
        )


def _graph_stages(n: int, r: np.ndarray, s_ram: np.ndarray, p_in: np.ndarray) -> list[int]:
    """The stage of each ``F(j)``'s graph instance: its last computation at or before ``B(j)``'s
    stage, held in RAM from there to ``B(j)`` without a page-in in between."""
    graph_stage = []
    for j in range(n):
        b = 2 * n - j  # the stage of B(j)
        if r[b + 1 :, j].any():
            raise _refuse(f"it recomputes F{j} after its backward, which nothing reads")
        t = int(np.flatnonzero(r[: b + 1, j])[-1])
        if t < b and not (s_ram[t + 1 : b + 1, j].all() and not p_in[t:b, j].any()):
            raise _refuse(
                f"B{j} reads F{j} paged back in, but a backward needs the graph its forward "
                "built in RAM and the executor pages activations, not graphs (solve with runnable)"
            )
        graph_stage.append(t)
    return graph_stage


def _replay(
    n: int,
    graph_stage: list[int],
    r: np.ndarray,
    s_ram: np.ndarray,
    p_in: np.ndarray,
    p_out: np.ndarray,
) -> tuple[list[tuple[Op, int]], list[_Copy]]:
    """Walk the stages as the MILP sees them: the compute operations in order (forwards with a
    provisional kind, ``Fa`` for a graph instance, and backwards) and every copy of an activation
    with the operations that read it and whether it is paged out."""
    t_count = 2 * n + 1
    compute: list[tuple[Op, int]] = []
    copies: list[_Copy] = []
    current: dict[int, _Copy] = {}  # a[k] -> its copy in RAM (MILP's view), k in 1..n-1
    flash: dict[int, int] = {}  # a[k] -> page-ins left from its page file (0 or 1)

    def forward(t: int, j: int) -> None:
        source = current.get(j) if j > 0 else None
        if j > 0 and source is None:
            raise _refuse(f"stage {t} computes F{j} without a[{j}] in RAM")
        if source is not None:
            source.reads.append(len(compute))
        kind = Op.FORWARD_ALL if t == graph_stage[j] else Op.FORWARD_CHECKPOINT
        compute.append((kind, j))
        if j + 1 < n:
            current.pop(j + 1, None)  # a stale copy (recomputed while held) ends here
            copy = _Copy(j + 1, len(compute) - 1)
            copies.append(copy)
            current[j + 1] = copy

    for t in range(t_count):
        for i in np.flatnonzero(r[t]).tolist():
            if i == n:
                continue  # the loss: the caller's, no operation
            if i > n:
                compute.append((Op.BACKWARD, 2 * n - i))
                continue
            forward(t, i)
        for i in np.flatnonzero(p_out[t]).tolist():
            copy_out = current.get(i + 1)
            if copy_out is None or copy_out.paged_out:
                raise _refuse(f"stage {t} pages out F{i}, which is not in RAM")
            if flash.get(i + 1, 0):
                raise _refuse(f"stage {t} pages out F{i} while its last page is still unread")
            copy_out.paged_out = True
            flash[i + 1] = 1
        for i in np.flatnonzero(p_in[t]).tolist():
            if flash.get(i + 1, 0) < 1:
                raise _refuse(
                    f"stage {t} pages F{i} in a second time from one page-out; a page is read "
                    "once and deleted"
                )
            flash[i + 1] = 0
            copy_in = _Copy(i + 1, len(compute) - 1, paged_in=True)
            copies.append(copy_in)
            current[i + 1] = copy_in
        if t + 1 < t_count:
            for k in list(current):
                if not s_ram[t + 1, k - 1]:
                    del current[k]
    return compute, copies


def _place(
    chain: Chain, compute: list[tuple[Op, int]], copies: list[_Copy]
) -> list[tuple[Op, int]]:
    """The operations: the copies' page-ins, page-outs and discards placed around the compute
    operations, and ``Fn`` / ``Fc`` chosen for each forward that is not a graph instance."""
    n = chain.length
    pins_input = [_saves_input(chain, k) for k in range(n)]
    before: list[list[tuple[Op, int]]] = [[] for _ in range(len(compute))]
    after: list[list[tuple[Op, int]]] = [[] for _ in range(len(compute))]
    kinds = [kind for kind, _ in compute]
    backward_at = {k: index for index, (kind, k) in enumerate(compute) if kind is Op.BACKWARD}
    for copy in copies:
        if copy.paged_in:
            if copy.reads:
                before[copy.reads[0]].append((Op.PAGE_IN, copy.k))
            else:
                after[copy.made_at].append((Op.PAGE_IN, copy.k))
        last = copy.reads[-1] if copy.reads else copy.made_at
        if copy.paged_out:
            # A graph that holds this copy (a stage that saved it as its output or its input)
            # keeps it in memory until that stage's backward: page it out after that.
            at = last
            if kinds[copy.made_at] is Op.FORWARD_ALL and _saves_output(chain, copy.k - 1):
                at = max(at, backward_at.get(copy.k - 1, at))
            if copy.reads and kinds[last] is Op.FORWARD_ALL:
                if not pins_input[copy.k]:
                    raise _refuse(f"it pages a[{copy.k}] out after its last use")
                at = max(at, backward_at.get(copy.k, at))
            after[at].append((Op.PAGE_OUT, copy.k))
        elif copy.reads and kinds[last] is not Op.FORWARD_ALL:
            kinds[last] = Op.FORWARD_NOSAVE  # drops a[k] as it finishes
        elif not copy.reads:
            after[last].append((Op.DISCARD, copy.k))
    for index, (kind, j) in enumerate(compute):
        if kind is Op.FORWARD_CHECKPOINT and j == 0:
            kinds[index] = Op.FORWARD_NOSAVE  # a[0] is the caller's: never dropped
    ops: list[tuple[Op, int]] = []
    for index, (_, k) in enumerate(compute):
        ops += before[index]
        ops.append((kinds[index], k))
        ops += after[index]
    return ops


def _saves_input(chain: Chain, k: int) -> bool:
    """Whether the graph of stage ``k`` holds (part of) its input ``a[k]``."""
    stage = chain.stages[k]
    return bool(stage.saved_inputs) if stage.saved_inputs is not None else stage.saves_input


def _saves_output(chain: Chain, k: int) -> bool:
    """Whether the graph of stage ``k`` holds (part of) its output ``a[k+1]``."""
    stage = chain.stages[k]
    return bool(stage.saved_outputs) if stage.saved_outputs is not None else stage.saves_output


@dataclass(frozen=True)
class PoetPlan:
    """A POET plan for a chain, as the MILP found it and as the schedule that runs it.

    Attributes:
        result: what the MILP found and proved (status, energy, gap, matrices).
        schedule: the plan as operations (``Checkpointed(..., schedule=plan.schedule)``).
        cost: the schedule's simulated cost (peak bytes, chain seconds, pages).
        device_cost: the schedule's seconds and joules on the device.
    """

    result: milp.MilpResult
    schedule: Schedule
    cost: Cost
    device_cost: DeviceCost


def plan_poet(
    chain: Chain,
    device: EnergyProfile,
    *,
    memory: float | str,
    runtime: float | None = None,
    mode: milp.Mode = "hybrid",
    time_limit: float = 60.0,
    chain_flops_per_second: float = 1e9,
    runnable: bool = True,
) -> PoetPlan:
    """The least-energy plan of recomputation and paging for ``chain`` on ``device`` within
    ``memory`` bytes (or a size such as "2MB"; counted as :func:`~edgetrain.core.simulator.simulate`
    counts them) and
    ``runtime`` times the every-node-once compute time, as a schedule that runs.

    Raises :class:`InfeasibleBudget` when the MILP proves no plan fits or finds none in
    ``time_limit`` seconds, :class:`InvalidSchedule` when its plan cannot run exactly.
    """
    memory = parse_bytes(memory)
    graph = from_chain(chain, device, chain_flops_per_second=chain_flops_per_second)
    result = milp.solve(
        graph,
        ram_bytes=memory,
        runtime_factor=runtime,
        mode=mode,
        accounting="edgetrain",
        time_limit=time_limit,
        runnable=runnable,
    )
    if result.plan is None:
        smallest = result.smallest_ram_bytes
        tail = "" if smallest is None else f"; the smallest RAM that works is {smallest:.0f} bytes"
        raise InfeasibleBudget(
            f"POET finds no plan within {memory:.0f} bytes ({result.status}: {result.message})"
            f"{tail}",
            smallest,
        )
    schedule = schedule_from_plan(chain, graph, result.plan)
    params: dict[str, Any] = {
        "memory": memory,
        "runtime": runtime,
        "mode": mode,
        "device": device.name,
        "status": result.status,
        "energy_J": result.energy_joules,
        "gap": result.gap,
    }
    schedule = Schedule(schedule.length, schedule.kinds, schedule.indices, "poet", params)
    schedule = made_for(schedule, chain)
    cost = simulate(chain, schedule)
    on_device = device_cost(chain, schedule, device, chain_flops_per_second=chain_flops_per_second)
    check_against(result, cost, on_device, memory)
    return PoetPlan(result, schedule, cost, on_device)


def check_against(
    result: milp.MilpResult, cost: Cost, on_device: DeviceCost, memory: float | None
) -> None:
    """Refuse a schedule whose energy or time differs from the MILP's, or whose simulated peak
    is over the budget: it would not be the plan the MILP chose."""
    ev = result.evaluation
    assert ev is not None
    for name, ours, theirs in (
        ("energy", on_device.energy_joules, ev.energy_joules),
        ("time", on_device.seconds, ev.runtime_seconds),
    ):
        if not math.isclose(ours, theirs, rel_tol=TOLERANCE, abs_tol=1e-15):
            raise _refuse(f"its {name} as a schedule is {ours:.9g}, the MILP's is {theirs:.9g}")
    if memory is not None and cost.heap_peak_bytes > memory:
        raise _refuse(
            f"as a schedule it peaks at {cost.heap_peak_bytes} bytes, "
            f"over the {memory:.0f}-byte budget"
        )
