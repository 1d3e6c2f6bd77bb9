"""A plan prepared to run, one per state a step may be in: the schedule, its simulated costs and
the stages as they run (graph runs merged, see :func:`~edgetrain.core.graph_merge.graph_runs`),
the operations of each phase decoded once (:class:`PreparedPlan`), and how
:class:`~edgetrain.runtime.checkpointed.Checkpointed` makes one (:class:`Preparing`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from edgetrain import progress
from edgetrain.autograd.replay import autocast_label, autocast_state, autocasting
from edgetrain.autograd.stage_state import stage_params
from edgetrain.autograd.stages import signature
from edgetrain.core.accounting import fixed_training_bytes
from edgetrain.core.chain import Chain, Stage
from edgetrain.core.graph_merge import GraphRun, graph_runs, merged_schedule
from edgetrain.core.schedule import Op, Schedule, stores_everything
from edgetrain.core.simulator import Cost, simulate
from edgetrain.errors import InfeasibleBudget, InvalidInput, InvalidSchedule
from edgetrain.frontend.cuts import on_stage_input
from edgetrain.frontend.profiling import (
    StageMemo,
    graph_step_peaks,
    merged_chain,
    profile_chain,
    with_module_step,
)
from edgetrain.runtime.checks import check_made_for
from edgetrain.runtime.replanning import autocast_mismatch
from edgetrain.runtime.stage_cost import AsRun, as_run, time_limit
from edgetrain.runtime.stages_as_run import modules_as_run, own_params, stage_modules
from edgetrain.units import format_bytes

STAGE_SECONDS = 75e-6
"""The executor's own cost per stage it runs (Python and autograd: taps, hands, parameter
leaves, an engine call), in seconds: 60-95 µs measured on this machine by
``benchmarks/executor_overhead.py --per-stage``. A plan run as one graph pays it once."""
ONE_GRAPH_TRIES = 2
"""How many tighter plans :class:`Checkpointed` tries when its plan would run as one graph but,
so run, holds a little more than its memory budget allows."""
MERGE_GROWTH = 0.01
"""Without a memory budget (``max_recompute``, or a given plan), how much a merge of stages
into one graph may raise the plan's peak (a fraction of it). One graph may hold a little more:
ViT-Tiny's plan at 1.02 recomputes its LayerNorms and GELUs; as one graph each LayerNorm also
keeps its mean and deviation, 0.16 % more, for a step about 7 % faster."""


@dataclass(frozen=True)
class PreparedPlan:
    """Everything a plan sets up for one state (see
    :meth:`~edgetrain.runtime.replanning.Replanning._state`), kept by that state and restored
    as it is when a step comes back to it."""

    device: int | None  # the budget in bytes planned for (a rule's, read for this state)
    model: nn.Module  # the stages as captured for this state
    params: list[nn.Parameter]  # the model's parameters, in the order the interpreter uses
    chain: Chain  # the profiled chain
    schedule: Schedule  # the plan
    signature: str  # the input's shapes and dtypes, in words
    key: tuple[Any, ...]  # the state planned for
    sized: dict[GraphRun, Stage]  # each graph run's stage, sized as it runs
    stage_memo: StageMemo  # the stages sized on meta tensors for it (see merged_chain)
    costs: dict[bool, Cost]  # the plan's cost as it runs, per training loop
    stages: list[nn.Module]  # the chain's stages as modules
    stores_everything: bool  # plain autograd on the module
    one_graph: bool  # one graph run end to end, run by plain autograd
    one_graph_excess: int | None  # bytes over the budget as one graph, when it does not fit
    exec_stages: list[nn.Module]  # the stages as they run (graph runs merged)
    exec_first: list[int]  # the chain's stage each executed stage begins with
    exec_length: int
    as_run: AsRun  # what the plan costs the executor as it runs (stage_cost.as_run)
    stage_params: list[Any]  # per executed stage, its parameters (stage_state.stage_params)
    shared_params: set[int]  # parameters more than one executed stage uses
    forward_ops: list[tuple[Op, int]]
    backward_ops: list[tuple[Op, int]]
    rerun: set[int]  # executed stages run forward more than once
    runs: dict[int, int]  # how many times each of those runs forward
    snapshotted: set[int]  # stages reading buffers their forward changes
    snapshots: set[int]  # executed stages rerun from a snapshot of their buffers
    submodules: dict[int, list[nn.Module]]  # modules whose buffers a recomputation copies
    needs: dict[int, list[bool]]  # per executed stage, which inputs need a gradient
    exec_chain: Chain  # the chain as it runs (see explain)
    exec_plan: Schedule  # the plan on the executed stages


class Preparing:
    """How :class:`~edgetrain.runtime.checkpointed.Checkpointed` prepares a plan for a state:
    plan (or adopt a given schedule), simulate it, merge its graph runs, decode its operations;
    :meth:`_prepared` freezes the result and :meth:`_use` makes a kept one current."""

    merge_graph_runs: bool

    def _prepared(self) -> PreparedPlan:
        """The plan just made, as its state keeps it."""
        return PreparedPlan(
            device=self._device,
            model=self.model,
            params=self._params,
            chain=self.chain,
            schedule=self.schedule,
            signature=self._signature,
            key=self._key,
            sized=self._sized,
            stage_memo=self._stage_memo,
            costs=self._costs,
            stages=self._stages,
            stores_everything=self._stores_everything,
            one_graph=self._one_graph,
            one_graph_excess=self._one_graph_excess,
            exec_stages=self._exec_stages,
            exec_first=self._exec_first,
            exec_length=self._exec_length,
            as_run=self._as_run,
            stage_params=self._stage_params,
            shared_params=self._shared_params,
            forward_ops=self._forward_ops,
            backward_ops=self._backward_ops,
            rerun=self._rerun,
            runs=self._runs,
            snapshotted=self._snapshotted,
            snapshots=self._snapshots,
            submodules=self._submodules,
            needs=self._needs,
            exec_chain=self._exec_chain,
            exec_plan=self._exec_plan,
        )

    def _use(self, plan: PreparedPlan) -> None:
        """Make a kept plan the current one, as it was prepared."""
        self._device = plan.device
        self.model = plan.model
        self._params = plan.params
        self.chain = plan.chain
        self.schedule = plan.schedule
        self._signature = plan.signature
        self._key = plan.key
        self._sized = plan.sized
        self._stage_memo = plan.stage_memo
        self._costs = plan.costs
        self._stages = plan.stages
        self._stores_everything = plan.stores_everything
        self._one_graph = plan.one_graph
        self._one_graph_excess = plan.one_graph_excess
        self._exec_stages = plan.exec_stages
        self._exec_first = plan.exec_first
        self._exec_length = plan.exec_length
        self._as_run = plan.as_run
        self._stage_params = plan.stage_params
        self._shared_params = plan.shared_params
        self._forward_ops = plan.forward_ops
        self._backward_ops = plan.backward_ops
        self._rerun = plan.rerun
        self._runs = plan.runs
        self._snapshotted = plan.snapshotted
        self._snapshots = plan.snapshots
        self._submodules = plan.submodules
        self._needs = plan.needs
        self._exec_chain = plan.exec_chain
        self._exec_plan = plan.exec_plan

    def _make_plan(
        self,
        sample: Any,
        chain: Chain | None,
        schedule: Schedule | None,
        as_is: bool = False,
    ) -> None:
        """Plan for ``sample``'s state, in the training loop the gradients are in now (kept
        between steps or not)."""
        if chain is None:
            chain = profile_chain(self.model, sample, autocast=autocast_state(), timing="modelled")
        elif chain.autocast != autocast_label(autocast_state()):
            raise InvalidInput(autocast_mismatch(chain.autocast, autocast_label(autocast_state())))
        if self.model is not self.module and not as_is:
            # The store-all plan runs the module itself: its own step's peak counts too.
            chain = with_module_step(chain, on_stage_input(self.module, self.model), sample)
        self.chain = chain
        self._signature = signature(sample)
        self._key = self._state(sample)
        self._grads_exist = self._key[-1]  # plan for the loop the step starts in
        # A run's merged stage depends on its stages and the sample only: sized once for every
        # plan tried here (see the tighter plan below) and, on the same chain (``as_is``), for
        # the other training loop's plan too (most of its runs are this one's).
        if not as_is:
            self._sized: dict[GraphRun, Stage] = {}
            self._stage_memo = StageMemo()  # the stages no run merges, sized once
        if schedule is not None:
            check_made_for(schedule, self.chain)
            self._adopt(schedule, sample)
            if self._device is None and self._max_recompute is None and not self._given_bytes:
                # Another input or model state is planned for the memory this plan was made
                # for (its planner's budget, else its own peak), not for storing everything.
                made_for = schedule.params.get("budget_bytes")
                self._given_bytes = (
                    made_for if isinstance(made_for, int) else self._costs[False].heap_peak_bytes
                )
            return
        if self._rule is not None:
            self._device = self._ruled_device()
        if self._device is None and self._max_recompute is not None and not self._given_bytes:
            self._adopt_within_time(self._max_recompute, sample)
            return
        planned = self._planned(self._device)
        self._adopt(planned, sample)
        excess = self._one_graph_excess
        if self._device is None or excess is None:
            return
        # The plan is one graph run end to end but, as one graph, holds ``excess`` bytes more
        # than the budget allows (a LayerNorm's statistics: the DP fills the budget): the plan
        # for a budget less by that much may run as one graph, without the executor's cost per
        # stage. Kept when its time and that cost come to less; else the first plan is rebuilt.
        first = self.cost.seconds + STAGE_SECONDS * self._exec_length
        device = self._device
        for _ in range(ONE_GRAPH_TRIES):
            # Less by at least 0.5 % of the room for activations: the planner's budgets are
            # discrete, and the tighter plan may fill its own as closely.
            device -= max(2 * excess, int(0.005 * (device - self.fixed_bytes)))
            try:
                tighter = self._planned(device)
            except InfeasibleBudget:
                break
            self._adopt(tighter, sample)
            if self._one_graph or self._one_graph_excess is None:
                break
            excess = self._one_graph_excess
        if not self._one_graph or self.cost.seconds + STAGE_SECONDS > first:
            self._adopt(planned, sample)

    def _adopt_within_time(self, rho: float, sample: Any) -> None:
        """Make the plan of least memory that, as it runs (graph runs merged where they fit),
        predicts at most ``rho`` times plain autograd's time: the first of
        :meth:`~edgetrain.runtime.checkpointed.Checkpointed._plans_within_time` that does, the
        last of them (which keeps to ``rho`` stage by stage) otherwise."""
        with progress.task(f"planning {self.chain.length} stages of {self.chain.name}"):
            plans = self._plans_within_time(rho)
        limit = time_limit(self.chain, rho)
        for schedule in plans:
            self._adopt(schedule, sample)
            if self.predicted_seconds <= limit:
                return
        # The last plan keeps to rho stage by stage: its runs merged without what they rebuild.
        self._adopt(plans[-1], sample, rebuild=False)

    def _adopt(self, schedule: Schedule, sample: Any, rebuild: bool = True) -> None:
        """Make ``schedule`` the plan: its costs, the stages as they run (runs merged; with
        ``rebuild=False``, without the units that rebuild, which then run stage by stage)."""
        self.schedule = schedule
        try:
            self._costs = {
                exist: simulate(self.chain, schedule, grads_exist=exist) for exist in (False, True)
            }
        except InvalidSchedule as exc:
            raise InvalidSchedule(f"the plan does not fit this model: {exc}") from exc
        if self._device is not None:
            limit = self._device - self.reserve_bytes
            worst = self.fixed_bytes + self._costs[self.grads_exist].heap_peak_bytes
            if worst > limit:
                raise InfeasibleBudget(
                    f"the given plan needs {format_bytes(worst)}, more than "
                    f"the budget {format_bytes(limit)}; re-plan for this budget",
                    worst,
                )
        self._stages = stage_modules(self.model, self.chain)
        # Stages whose result depends on buffers their forward changes (spectral_norm): a run
        # again starts from a snapshot of their buffers taken before the first run.
        self._snapshotted = {
            k for k, stage in enumerate(self.chain.stages) if stage.reads_updated_buffers
        }
        # The store-all plan runs as plain autograd when its peak was measured so (the chain's
        # autograd_peak_bytes, which simulate() gives it); otherwise stage by stage, as counted.
        self._stores_everything = (
            stores_everything(schedule) and self.chain.autograd_peak_bytes is not None
        )
        index_of = {id(p): i for i, p in enumerate(self._params)}
        fine = [stage_params(m, index_of) for m in self._stages]
        # What every step runs, decoded once: the stages as they run (a run of the plan's that
        # can run as one graph, one stage: see graph_runs), the operations of each phase, and
        # the stages run more than once (only their random-number state is kept for a replay).
        self._one_graph = False  # the plan runs as one graph run by plain autograd (_merge)
        self._one_graph_excess: int | None = None  # bytes over, when it could but does not fit
        merging = self.merge_graph_runs and not self._stores_everything
        runs = list(graph_runs(schedule)) if merging else []
        if not rebuild:
            runs = [part for run in runs for part in run.without(run.rebuilds)]
        chosen, self._exec_first, executed = self._merge(
            runs, schedule, sample, lambda run: own_params(fine, run)
        )
        self._exec_stages = modules_as_run(self._stages, chosen, self._snapshotted)
        self._exec_length = executed.length
        self._as_run = as_run(schedule, chosen) if not self._stores_everything else AsRun(0, 0, 0)
        self._stage_params = [
            fine[k] if module is self._stages[k] else stage_params(module, index_of)
            for k, module in zip(self._exec_first, self._exec_stages, strict=True)
        ]
        # Parameters that more than one stage as run uses (a tied weight): their gradients are
        # summed over the stages before autograd adds them to .grad (see StepRun.receive).
        users = Counter(i for stage in self._stage_params for i, _ in stage.params)
        self._shared_params = {i for i, count in users.items() if count > 1}
        ops = list(executed)
        self._forward_ops = ops[: executed.forward_phase_end]
        self._backward_ops = ops[executed.forward_phase_end :]
        forwards = Counter(k for kind, k in ops if kind.is_forward)
        self._rerun = {k for k, count in forwards.items() if count > 1}
        self._runs = {k: forwards[k] for k in self._rerun}
        # A recomputation runs on copies of the buffers of these modules (see recomputing): those
        # the chain counts (Stage.copied_buffer_bytes, from buffer_copy_bytes).
        self._submodules = {k: list(self._exec_stages[k].modules()) for k in self._rerun}
        bounds = [*self._exec_first, self.chain.length]
        self._snapshots = {
            k
            for k in self._rerun
            if any(j in self._snapshotted for j in range(bounds[k], bounds[k + 1]))
        }
        self._needs: dict[int, list[bool]] = {}  # per stage, filled as the stages first run

    def _merge(
        self,
        runs: list[GraphRun],
        schedule: Schedule,
        sample: Any,
        owns: Callable[[GraphRun], bool],
    ) -> tuple[list[GraphRun], list[int], Schedule]:
        """The runs to merge, the chain's stage each executed stage begins with, and the plan on
        the executed stages. Each run of :func:`graph_runs` is sized as it runs (one graph: it
        may hold more or less than its stages one by one; a parameter used twice in a run, for
        one, has its first gradient held by autograd until the second comes when the loop keeps
        gradients) and merged when the plan, so run, still fits in either training loop: within
        ``memory_budget`` when one is given, else within :data:`MERGE_GROWTH` of the plan's own
        peak and within the budget a given plan was made for. The plan's :attr:`cost` is then
        that of the stages as they run. Only runs that ``owns`` (no stage outside uses their
        parameters: see :func:`own_params`) are merged."""
        runs = [run for run in runs if owns(run) or run.rebuilds]
        self._exec_chain, self._exec_plan = self.chain, schedule  # as it runs (see explain)
        if not runs:
            return [], *merged_schedule(schedule, [])
        as_one = self._sized  # each run's stage, sized as it runs (kept across plans: _plan)

        def size(candidates: list[GraphRun]) -> None:
            self._size_runs(candidates, schedule, sample)

        allowed = self._merge_allowed(schedule)

        def costs(chosen: list[GraphRun]) -> dict[bool, Cost]:
            return self._merged_costs(schedule, chosen)

        def over(cost: dict[bool, Cost]) -> int:
            """How far the worse of the two loops is above what it allows (bytes): its tensors
            or its heap, whichever is further."""
            return math.ceil(
                max(
                    max(c.peak_bytes - allowed[e][0], c.heap_peak_bytes - allowed[e][1])
                    for e, c in cost.items()
                )
            )

        def fits(chosen: list[GraphRun]) -> bool:
            return over(costs(chosen)) <= 0

        def fit(run: GraphRun) -> bool:
            return run in as_one and fits([run])

        whole = [run for run in runs if owns(run)]
        size(whole)
        chosen = [run for run in whole if fit(run)]
        # A run that does not fit whole: without the pairs and segments that do not fit alone
        # (one graph may hold more of a pair: a Dropout's mask), else as stored parts.
        rest = [run for run in runs if run.rebuilds and run not in chosen]
        pairs = [pair for run in rest for pair in run.pairs()]
        size(pairs)
        pieces = [
            piece
            for run in rest
            for piece in run.without({p.first for p in run.pairs() if not fit(p)})
            if owns(piece)
        ]
        size(pieces)  # each size() profiles the whole model once: one per kind of candidate
        chosen += [piece for piece in pieces if fit(piece)]
        parts = [
            part
            for piece in pieces
            if not fit(piece)
            for part in piece.without(piece.rebuilds)
            if owns(part)
        ]
        size(parts)
        chosen += [part for part in parts if fit(part)]
        chosen.sort(key=lambda run: run.first)
        while chosen and not fits(chosen):  # each fits alone, not together: drop the last
            chosen.pop()
        if chosen:
            self._costs = costs(chosen)
        first, plan = merged_schedule(schedule, chosen)
        if chosen:
            merged = {run.first: as_one[run] for run in chosen}
            stages = tuple(merged.get(k, self.chain.stages[k]) for k in first)
            self._exec_chain = replace(self.chain, stages=stages, autograd_peak_bytes=None)
            self._exec_plan = plan
        self._merge_as_one_graph(chosen, whole, schedule, plan, sample, over)
        return chosen, first, plan

    def _size_runs(self, candidates: list[GraphRun], schedule: Schedule, sample: Any) -> None:
        """Size each of ``candidates`` not sized yet as one graph (see :meth:`_merge`)."""
        as_one = self._sized
        candidates = [run for run in candidates if run not in as_one]
        if not candidates:
            return
        first, _ = merged_schedule(schedule, candidates)
        modules = modules_as_run(self._stages, candidates, self._snapshotted)
        with autocasting(autocast_state()):  # as the step runs them (see autocasting)
            sized = merged_chain(self.chain, modules, first, sample, self._stage_memo)
        if sized is not None:
            by_first = dict(zip(first, sized.stages, strict=True))
            as_one.update({run: by_first[run.first] for run in candidates})

    def _merge_allowed(self, schedule: Schedule) -> dict[bool, tuple[float, float]]:
        """Per training loop, the tensor peak and the heap peak (tensors and kernel scratch) a
        plan with runs merged may have (see :meth:`_merge`): the heap within ``memory_budget``
        when one is given; else the tensors within :data:`MERGE_GROWTH` of the plan's own and
        the heap within the budget a given plan was made for. Without a budget the heap is not
        bounded by the plan's own: a run's scratch counts in full on top of its merged peak (a
        bound), which is more than the stages one by one count."""
        planned_for = schedule.params.get("budget_bytes")  # the planner's, for a given plan
        allowed: dict[bool, tuple[float, float]] = {}
        for exist, cost in self._costs.items():
            if self._device is not None:
                # What a step starts with in this loop (see fixed_bytes), and the reserve.
                grads = 0 if exist else self.chain.gradient_bytes
                fixed = fixed_training_bytes(self.chain) - grads + self.reserve_bytes
                allowed[exist] = (math.inf, max(cost.heap_peak_bytes, self._device - fixed))
            else:
                heap = math.inf
                if isinstance(planned_for, int):
                    heap = max(cost.heap_peak_bytes, planned_for)
                allowed[exist] = (cost.peak_bytes * (1 + MERGE_GROWTH), heap)
        return allowed

    def _merged_costs(self, schedule: Schedule, chosen: list[GraphRun]) -> dict[bool, Cost]:
        """The plan's cost with ``chosen`` merged: its peak as it runs; its time, steps and
        recompute factor the plan's (a rebuild is the plan's recomputation)."""
        starts, plan = merged_schedule(schedule, chosen)
        merged = {run.first: self._sized[run] for run in chosen}
        stages = tuple(merged.get(k, self.chain.stages[k]) for k in starts)
        chain = replace(self.chain, stages=stages, autograd_peak_bytes=None)
        return {
            exist: _peaks_of(fine, simulate(chain, plan, grads_exist=exist))
            for exist, fine in self._costs.items()
        }

    def _merge_as_one_graph(
        self,
        chosen: list[GraphRun],
        whole: list[GraphRun],
        schedule: Schedule,
        plan: Schedule,
        sample: Any,
        over: Callable[[dict[bool, Cost]], int],
    ) -> None:
        """Whether the merged plan runs as one graph end to end (plain autograd on it, see
        :attr:`_one_graph`), or by how much it would hold more than allowed so run."""
        as_one = self._sized
        spans = [(run.first, run.last) for run in chosen]
        ends = [(run.first, run.last) for run in whole]
        if ends == [(0, self.chain.length - 1)] and whole[0].rebuilds and whole[0] in as_one:
            # How much more than allowed the whole model as one graph holds (see _plan).
            self._one_graph_excess = over(self._merged_costs(schedule, [whole[0]]))
        if spans == [(0, self.chain.length - 1)] and chosen[0].rebuilds:
            # One graph for the whole model: plain autograd runs it (as a store-all plan runs
            # the module), its step measured as it runs; if that fits too.
            peaks = graph_step_peaks(
                modules_as_run(self._stages, chosen, self._snapshotted)[0], sample
            )
            if peaks is not None:
                one = replace(self.chain, stages=(as_one[chosen[0]],), autograd_peak_bytes=peaks)
                direct = {
                    e: _peaks_of(c, simulate(one, plan, grads_exist=e))
                    for e, c in self._costs.items()
                }
                self._one_graph_excess = over(direct)
                if self._one_graph_excess <= 0:
                    self._costs, self._one_graph = direct, True
                    self._exec_chain = one
        if self._one_graph_excess is not None and self._one_graph_excess <= 0:
            self._one_graph_excess = None


def _peaks_of(cost: Cost, run: Cost) -> Cost:
    """``cost`` (the plan's time, steps and recompute factor) with the peaks of ``run`` (the
    plan as it runs, runs merged): tensors and the heap beyond them."""
    return replace(cost, peak_bytes=run.peak_bytes, heap_extra_bytes=run.heap_extra_bytes)
