"""Checkpointed: run a Schedule inside autograd, as an ``nn.Module``.

    net = edgetrain.Checkpointed(model, sample_input, memory_budget="512MB")
    loss = criterion(net(x), target)
    loss.backward()              # runs the plan's backward phase; gradients land in .grad

A plan is prepared for each state a step may be in (:mod:`edgetrain.runtime.prepared`: a frozen
:class:`~edgetrain.runtime.prepared.PreparedPlan`), kept by that state and made again when the
state changes (:mod:`edgetrain.runtime.replanning`), and run inside autograd by the interpreter
of its operations (:mod:`edgetrain.runtime.interpreter`).

Contract (compare ``torch.utils.checkpoint``). What is the same as plain autograd on the same
inputs and random-number state:

* outputs, input gradients and parameter gradients (bitwise, in practice: the same kernels run
  on tensors of the same memory layouts, ``channels_last`` included);
* what the caller's backward asks for: ``loss.backward()`` fills every ``.grad``;
  ``torch.autograd.grad(loss, x)`` and ``loss.backward(inputs=[x])`` touch no parameter's
  ``.grad``; ``torch.autograd.grad(loss, params)`` returns the parameters' gradients. Parameter
  gradients reach autograd once per step, summed over every stage that uses the parameter (tied
  and reused layers), so tensor hooks and post-accumulate-grad hooks run once, as without
  checkpointing; frozen parameters get none; a gradient stopped inside a stage (``detach``,
  ``torch.no_grad()``, a ``no_grad`` block in a captured ``forward()``) leaves the gradients
  before it ``None``; a ``torch.autocast`` region in a captured ``forward()`` runs as it does
  there (:mod:`edgetrain.frontend.fx_capture` keeps each region in one stage);
* random numbers: every stage runs once in the forward pass; a recomputation replays the
  random-number state the stage saw first (dropout masks are the same), and the caller's stream
  goes on as usual;
* buffers: a recomputation runs on copies of the stage's buffers, so BatchNorm running statistics
  and ``num_batches_tracked`` end exactly as without checkpointing; a stage whose result depends
  on buffers its forward changes (``spectral_norm``'s power iteration, a moving average the
  module reads) is recomputed from copies of its buffers as they were before its first run
  (a snapshot the plan counts: :attr:`~edgetrain.core.chain.Stage.reads_updated_buffers`);
* autocast: every stage run (recomputations too) is under the autocast state of the forward,
  without autocast's cache of weight copies (a copy lives as long as autograd saves it, as the
  profile, made under the same state, counts it);
* inputs may be a tensor or, for an ``nn.Sequential``, a tuple, list or dict of tensors, or for
  a captured model a dict of ``forward()``'s keyword arguments, called as ``net(**inputs)``
  (only floating-point tensors carry gradients); stages may pass such structures between them; an
  output the loss does not use leaves its layers' gradients ``None``;
* a plan is made for the input's shapes and dtypes, which parameters and inputs need a
  gradient, each module's train/eval mode, the autocast state and, for a captured model, the
  plain Python attributes its ``forward()`` reads (fx traced their values in): a step that
  differs in any of them is planned for anew (plans are kept per state, at most
  :data:`KEPT_PLANS`), or refused with ``on_new_shape="error"``;
* under ``torch.no_grad()``, or when nothing needs a gradient, the model just runs; so it does
  when the plan stores everything (plain autograd's step, which holds no more than predicted);
  a plan whose every stage belongs to one graph run (:func:`~edgetrain.core.graph_merge.graph_runs`:
  stages stored, recomputed for the backward of the stage after them, or checkpointed segments)
  is plain autograd on that run (:class:`~edgetrain.autograd.replay.GraphRunModule`), its step
  measured as it runs.

What is refused with one clear error (before any gradient, buffer or RNG state changes):

* a second backward through the same step (``retain_graph``) and double backward
  (``create_graph=True``, e.g. gradient penalties): run those without checkpointing;
* an input or parameter changed in place between the forward and the backward, as autograd does;
* hooks registered on the wrapped model itself (register them on ``Checkpointed`` or on its
  children), and models torch.fx cannot trace (control flow on tensor values);
* a saved plan made for another model, batch or input size; a captured model given a tuple,
  list or dict; a model that returns its own input; a captured model whose ``forward()``
  assigns to a module attribute (fx records calls, not assignments).

Not yet right (open): with gradients accumulated over micro-batches, a parameter also used
outside the model in the same step (an L2 penalty, two calls in one step) is added to ``.grad``
in another order than autograd's (equal up to rounding); forward hooks on children run again in
each recomputation.

Memory: what the step holds above what it started with (weights, buffers, input, and gradients if
they exist) is the plan's ``Cost.peak_bytes`` for the sample input's shape, as counted by
:class:`~edgetrain.autograd.storage_counter.StorageCounter`, in both training loops
(``zero_grad()`` setting
gradients to ``None``, PyTorch's default, or keeping them): each parameter gradient leaves its
stage as soon as autograd computes it, and is added in place to an existing ``.grad`` (kept
gradients) or held, summed over the stages that use the parameter, for autograd to take at the
end of the backward (``None`` gradients, and kept gradients of a parameter several stages use:
autograd sums a parameter's uses before it adds to ``.grad``, so gradients accumulated over
micro-batches are bitwise plain autograd's). An input of another shape is planned for anew
(``on_new_shape="replan"``, the default) or refused (``"error"``). The loss the caller computes
between the forward and the backward is the caller's: what it holds
(for ``cross_entropy`` about twice the output's bytes, more for a large output such as a language
model's logits) comes on top; leave room for it with ``reserve_bytes``.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from edgetrain import progress
from edgetrain.autograd.heap import HeapPeak
from edgetrain.autograd.stages import leaves
from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.core.accounting import fixed_training_bytes
from edgetrain.core.chain import Chain
from edgetrain.core.explain import UNSPLIT, PeakExplanation, explain_plan
from edgetrain.core.schedule import Schedule
from edgetrain.core.simulator import Cost, simulate
from edgetrain.errors import InvalidInput
from edgetrain.frontend.cuts import as_stages, stage_input
from edgetrain.frontend.profiling import (
    analytic_chain,
)
from edgetrain.planners.optimal import store_all
from edgetrain.planners.search import plan, plan_for_device
from edgetrain.planners.sequential import sequential
from edgetrain.runtime.checks import (
    BUDGET_RULES,
    check_budget_holds_weights,
    check_plan_for,
    device_bytes,
    refuse_hooks,
)
from edgetrain.runtime.interpreter import (
    ScheduleFunction,
    StepRun,
    Watch,
    gradients_kept,
)
from edgetrain.runtime.paging import PageStore
from edgetrain.runtime.peak_probe import PeakProbe
from edgetrain.runtime.prepared import PreparedPlan, Preparing
from edgetrain.runtime.replanning import Replanning
from edgetrain.runtime.stage_cost import (
    ExecutorSeconds,
    cached_rebuild_seconds,
    cached_stage_seconds,
    plans_within_time,
)
from edgetrain.units import parse_bytes

_NEW_SHAPE = ("replan", "error")


class Checkpointed(Replanning, Preparing, nn.Module):
    """Train an ``nn.Sequential`` within a memory budget by running a checkpointing plan.

    Args:
        model: the model to train: an ``nn.Sequential`` (its entries are the stages) or any
            module torch.fx can trace (cut between the blocks that a single tensor leaves).
        sample_input: an input of the shape training will use; profiled on this device. A
            captured model may take a mapping of ``forward()``'s keyword arguments to tensors
            (a Hugging Face model's ``{"input_ids": ..., "labels": ...}``), then called as
            ``net(**inputs)``.
        memory_budget: bytes (or "512MB") the step may use for weights, gradients, buffers,
            the input and activations together; the plan is the fastest that fits. ``"min"``:
            the smallest budget that plans; ``"auto"``: the knee of the memory/time frontier
            (:func:`edgetrain.runtime.frontier.knee`: with memory and time each scaled to [0, 1]
            between the smallest budget's plan and storing everything, the plan farthest below
            the straight line between those two). Either is chosen again for each input shape
            and loop planned for.
        max_recompute: alternatively, the largest recompute factor (time over plain autograd's,
            >= 1); the plan then uses the least memory that keeps to it.
        strategy: "optimal" (dynamic program), "revolve" or "sequential".
        reserve_bytes: memory to leave for other things (optimizer state ...) out of
            ``memory_budget`` (bytes or a size such as "64MB").
        chain: a chain to plan on instead of profiling ``model`` (e.g. an analytic one).
        schedule: a ready plan (e.g. ``Schedule.load(path)``) instead of planning; refused if it
            was made for another model or input size.
        on_new_shape: "replan" (profile and plan again for an input of another shape, or when
            what needs a gradient or a module's train/eval mode changed since planning: a layer
            unfrozen, ``model.eval()``) or "error" (a change of training loop alone is planned
            for either way, on the same profile). A plan made once is kept for its input and
            model state: coming back to them runs it again (a given ``schedule`` too; for other
            inputs and states, plans are made for the memory the given one was made for). The
            step that plans profiles the model first: its peak is the profile's, which can be
            above a tight budget (call the model once per input shape before that matters).
        page_dir: directory for the page files of a plan that pages activations out (``Po k`` /
            ``Pi k``): the "SD card". Written by a background thread, checksummed, verified when
            read back, deleted after use (see :mod:`edgetrain.runtime.paging`).
        leaf_modules: module classes the capture keeps as one call each, not traced into
            (a block whose ``forward()`` torch.fx cannot trace); each is one stage at most.
        merge_graph_runs: run each graph run of the plan as one stage
            (:func:`~edgetrain.core.graph_merge.graph_runs`); False runs every stage on its own
            (a diagnostic: the executor's cost per stage, the plan as the simulator counts it).

    Attributes:
        chain: the profiled chain. schedule: the plan. cost: its simulated cost (``peak_bytes``:
        the most the step holds above what it starts with; seconds; recompute factor).
    """

    def __init__(
        self,
        model: nn.Module,
        sample_input: Any,
        *,
        memory_budget: int | float | str | None = None,
        max_recompute: float | None = None,
        strategy: str = "optimal",
        reserve_bytes: int | float | str = 0,
        chain: Chain | None = None,
        schedule: Schedule | None = None,
        on_new_shape: str = "replan",
        page_dir: str | Path | None = None,
        merge_graph_runs: bool = True,
        leaf_modules: Sequence[type[nn.Module]] = (),
    ) -> None:
        super().__init__()
        refuse_hooks(model)
        if on_new_shape not in _NEW_SHAPE:
            raise InvalidInput(f"on_new_shape must be one of {', '.join(_NEW_SHAPE)}")
        self.reserve_bytes = 0 if reserve_bytes in (0, "0") else parse_bytes(reserve_bytes)
        self._rule = memory_budget if memory_budget in BUDGET_RULES else None
        if self._rule is not None and schedule is not None:
            raise InvalidInput(
                f"memory_budget={self._rule!r} chooses a plan; give no schedule, or a budget in "
                "bytes to check the schedule against"
            )
        self.module = model
        self.leaf_modules = tuple(leaf_modules)
        self.model = as_stages(model, sample_input, leaf_modules=self.leaf_modules)
        sample_input = stage_input(self.model, sample_input)
        self._device = None if memory_budget is None else device_bytes(memory_budget)
        if self._device:  # before the profile: from the sizes alone
            check_budget_holds_weights(
                self._device, self.model, sample_input, self.reserve_bytes, strategy, chain
            )
        if schedule is not None:
            check_plan_for(schedule, self.model, sample_input, type(model).__name__)
        self.strategy = strategy
        self.merge_graph_runs = merge_graph_runs
        self.on_new_shape = on_new_shape
        self._max_recompute = max_recompute
        self._params = list(self.model.parameters())
        self._grads_exist: bool | None = None
        self._probe: PeakProbe | None = None  # the step being measured (see measuring)
        self._measured: PeakProbe | None = None  # the last step measured
        # Plans made so far, by what each was made for (see _state), made current again as they
        # were prepared when a step comes back to that state.
        self._plans: dict[tuple[Any, ...], PreparedPlan] = {}
        self._key: tuple[Any, ...] = ()  # what the current plan was made for (_state)
        self._unplanned = False  # a new plan failed half way: plan again at the next step
        self._given_bytes = 0  # activation bytes a given schedule was made for (see _plan)
        self.page_dir = None if page_dir is None else Path(page_dir)
        if self.page_dir is not None:
            PageStore(self.page_dir).close()  # refuse an unusable directory now, not mid-step
        self._plan(sample_input, chain, schedule)
        if self.cost.pages_out and self.page_dir is None:
            raise InvalidInput(
                "this plan pages activations out to files; give page_dir= a writable directory"
            )

    # -- planning ----------------------------------------------------------------------------------

    def _ruled_device(self) -> int:
        """The budget ``memory_budget="min"`` or ``"auto"`` stands for on this chain and loop."""
        from edgetrain.runtime.frontier import frontier, knee

        points = frontier(
            self.chain,
            strategy=self.strategy,
            grads_exist=self.grads_exist,
            fixed_bytes=self.fixed_bytes + self.reserve_bytes,
        )
        return (points[0] if self._rule == "min" else knee(points)).budget_bytes

    def _planned(self, device: int | None) -> Schedule:
        """The planner's plan for a memory budget of ``device`` bytes (None: none)."""
        # Shown only when planning takes more than a couple of seconds (long chains).
        with progress.task(f"planning {self.chain.length} stages of {self.chain.name}"):
            if device is None and self._given_bytes:
                return plan(
                    self.chain,
                    self.strategy,
                    memory=self._given_bytes,
                    grads_exist=self.grads_exist,
                )
            if device is None and self._max_recompute is not None:
                return self._plans_within_time(self._max_recompute)[-1]
            return plan_for_device(
                self.chain,
                self.strategy,
                device_bytes=device,
                fixed_bytes=self.fixed_bytes + self.reserve_bytes,
                max_recompute=self._max_recompute,
                grads_exist=self.grads_exist,
            )

    def _plans_within_time(self, rho: float) -> list[Schedule]:
        """Plans to try for ``max_recompute=rho``, least memory first, the last one within
        ``rho`` stage by stage (:func:`~edgetrain.runtime.stage_cost.plans_within_time`)."""
        costs = executor_seconds() if rho >= 1.0 else ExecutorSeconds(0.0, 0.0, 0.0)
        return plans_within_time(self.chain, self.strategy, rho, costs, self.grads_exist)

    @property
    def runs_as(self) -> str:
        """How a step runs: "the module itself" (a plan that stores everything), "one graph"
        (every stage in one graph run, :class:`~edgetrain.autograd.replay.GraphRunModule`), or "N
        stages" (the executor's, some of them runs merged)."""
        if self._stores_everything:
            return "the module itself"
        if self._one_graph:
            return "one graph"
        return f"{self._exec_length} stages"

    @property
    def grads_exist(self) -> bool:
        """Whether the training loop keeps gradients between steps: whether the last step found
        them all (and no hook on them); before the first step, whether they exist now."""
        if self._grads_exist is None:
            return gradients_kept(p for p in self._params if p.requires_grad)
        return self._grads_exist

    @property
    def cost(self) -> Cost:
        """The plan's simulated cost in this training loop (see :attr:`grads_exist`)."""
        return self._costs[self.grads_exist]

    @property
    def fixed_bytes(self) -> int:
        """Weights, buffers and the input, and the gradients when the loop keeps them: what a
        step starts with."""
        grads = self.chain.gradient_bytes if self.grads_exist else 0
        return fixed_training_bytes(self.chain) - self.chain.gradient_bytes + grads

    @property
    def predicted_seconds(self) -> float:
        """The step's predicted time: the plan's compute (``cost.seconds``, the stages' profiled
        times) and the executor's own as the plan runs (graph runs merged): per stage operation
        run stage by stage, per unit rebuilt inside a graph run and per stage it rebuilds,
        measured on this machine (:func:`executor_seconds`)."""
        if self._stores_everything:
            return self.cost.seconds
        return self.cost.seconds + executor_seconds().of(self._as_run)

    @property
    def predicted_recompute_factor(self) -> float:
        """:attr:`predicted_seconds` over plain autograd's compute (the module run itself)."""
        plain = self.chain.forward_seconds + self.chain.backward_seconds
        return self.predicted_seconds / plain if plain > 0 else float("nan")

    @property
    def plain_cost(self) -> Cost:
        """Plain autograd's step as a plan (everything stored), on the same basis as ``cost``."""
        return simulate(self.chain, store_all(self.chain), grads_exist=self.grads_exist)

    @property
    def plain_peak_bytes(self) -> int:
        """Predicted peak of the whole step under plain autograd: fixed + its activation peak."""
        return self.fixed_bytes + self.plain_cost.peak_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """Predicted peak of the whole step: :attr:`fixed_bytes` + the plan's ``peak_bytes``."""
        return self.fixed_bytes + self.cost.peak_bytes

    # -- explaining --------------------------------------------------------------------------------

    def _peak_position(self, grads_exist: bool) -> int:
        """The operation of the plan as it runs at which its predicted peak is."""
        return simulate(self._exec_chain, self._exec_plan, grads_exist=grads_exist).peak_op

    def explain(self) -> PeakExplanation:
        """What the step holds at its predicted peak, by category (weights, buffers, input,
        gradients kept from the last step, the reserve, checkpoints and kept graphs by stage,
        activation and parameter gradients, the stage running) and the operation where it
        happens, for the training loop planned for (:attr:`grads_exist`); derived from the
        simulator's replay of the plan as it runs (stages merged into graph runs). After a step
        run inside :meth:`measuring` (same input state and loop), the measured bytes per
        category stand beside the predicted (see :mod:`edgetrain.runtime.peak_probe`)."""
        loop = self.grads_exist
        chain = self.chain
        fixed = {
            "weights": chain.weight_bytes,
            "buffers": chain.buffer_bytes,
            "input": chain.input_bytes,
        }
        fixed["gradients"] = self.fixed_bytes - sum(fixed.values())
        fixed["reserve"] = self.reserve_bytes
        explained = explain_plan(
            self._exec_chain,
            self._exec_plan,
            grads_exist=loop,
            fixed=fixed,
            plain_peak_bytes=self.plain_cost.peak_bytes,
        )
        probe = self._measured
        if probe is None or probe.key != self._key or probe.grads_exist != loop:
            return explained
        step = probe.parts or {UNSPLIT: probe.step_peak_bytes or 0}
        measured = {**probe.fixed, **step}
        return replace(
            explained,
            measured=measured,
            measured_peak_bytes=sum(probe.fixed.values()) + (probe.step_peak_bytes or 0),
            heap_peak_bytes=probe.heap_peak_bytes,
        )

    @contextmanager
    def measuring(self) -> Iterator[PeakProbe]:
        """Measure the step run inside (``loss = f(net(x)); loss.backward()``) with the exact
        tensor counter, for :meth:`explain` to show beside its prediction::

            with net.measuring():
                loss_fn(net(x), y).backward()
            print(net.explain())
        """
        probe = PeakProbe(StorageCounter(), -1)
        self._probe = probe
        heap = HeapPeak()
        try:
            with heap, probe.counter:
                yield probe
        finally:
            self._probe = None
        probe.step_peak_bytes = probe.counter.peak_bytes
        probe.heap_peak_bytes = heap.peak_bytes
        self._measured = probe

    # -- running -----------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """One step's forward: ``net(x)``, or ``net(**inputs)`` for a model planned for a
        mapping of keyword inputs (a Hugging Face model's ``input_ids``, ``labels``, ...)."""
        if kwargs and not args:
            if getattr(self.model, "input_names", None) is None:
                raise InvalidInput(
                    f"the model was captured for positional input, called with keyword inputs "
                    f"{', '.join(kwargs)}; call it as net(x), as it was planned"
                )
            return self._forward(stage_input(self.model, kwargs), kwargs)
        if len(args) != 1 or kwargs:
            raise InvalidInput(
                "call Checkpointed with one input, net(x), or with keyword inputs only, "
                "net(**inputs), as it was planned"
            )
        return self._forward(args[0], None)

    def _call_module(self, x: Any, given: dict[str, Any] | None) -> Any:
        return self.module(x) if given is None else self.module(**given)

    def _forward(self, x: Any, given: dict[str, Any] | None) -> Any:
        refuse_hooks(self.module)
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        params = [self._params[i] for i in trainable]
        inputs = leaves(x)
        if not torch.is_grad_enabled() or not (any(t.requires_grad for t in inputs) or params):
            return self._call_module(x, given)
        key = self._state(x)
        if key != self._key or self._unplanned:
            self._plan_for(x, key, given)
            return self._forward(x, given)  # the step, on the plan and parameters for this state
        self._grads_exist = gradients_kept(params)  # the loop this step runs in
        probe = self._probe
        if probe is not None:
            probe.key, probe.grads_exist = self._key, self._grads_exist
            probe.position = self._peak_position(self._grads_exist)
            probe.measure_fixed(params, list(self.model.buffers()), x)
        if self._stores_everything:
            # Every stage once with its graph, nothing recomputed: plain autograd on the module,
            # whose step's peak was measured (Chain.autograd_peak_bytes); no executor overhead.
            return self._call_module(x, given)
        if self._one_graph:
            # The whole plan one graph that rebuilds the outputs it recomputes (GraphRunModule):
            # plain autograd on it, its step's peak measured as it runs; the inputs and
            # parameters watched as the executor watches them (a rebuild reads them again).
            watched = [(t, t._version) for t in (*inputs, *params)]
            flat, spec = tree_flatten(self._exec_stages[0](x))
            grads = [
                i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            outs = Watch.apply(watched, *(flat[i] for i in grads))
            for i, out in zip(grads, outs, strict=True):
                flat[i] = out
            return tree_unflatten(flat, spec)
        run = StepRun(self, x, trainable, probe=probe)
        views = [t.view_as(t) if t.requires_grad else t for t in inputs]
        outs = ScheduleFunction.apply(run, len(views), *views, *(p.view_as(p) for p in params))
        return run.output(outs)

    def extra_repr(self) -> str:
        return (
            f"strategy={self.schedule.strategy!r}, stages={self.chain.length}, "
            f"peak_bytes={self.cost.peak_bytes}, recompute_factor={self.cost.recompute_factor:.3f}"
        )


CALIBRATION_STAGES = 32
CALIBRATION_BLOCKS = 12
CALIBRATION_ROUNDS = 21


def stage_seconds() -> float:
    """The executor's cost per stage operation on this machine, in seconds: measured once by
    :func:`measure_stage_seconds` and cached
    (:func:`~edgetrain.runtime.stage_cost.cached_stage_seconds`;
    ``$EDGETRAIN_STAGE_SECONDS`` sets it instead)."""
    return cached_stage_seconds(measure_stage_seconds)


def executor_seconds() -> ExecutorSeconds:
    """The executor's costs on this machine: :func:`stage_seconds` and what a unit rebuilt
    inside a graph run and each stage it rebuilds cost beyond their compute, measured once by
    :func:`measure_rebuild_seconds` and cached
    (:func:`~edgetrain.runtime.stage_cost.cached_rebuild_seconds`)."""
    return ExecutorSeconds(stage_seconds(), *cached_rebuild_seconds(measure_rebuild_seconds))


def measure_stage_seconds(
    stages: int = CALIBRATION_STAGES, rounds: int = CALIBRATION_ROUNDS
) -> float:
    """One measurement of the executor's cost per stage operation (seconds, at least 0): a
    chain of tiny stages run stage by stage, over plain autograd, per stage operation."""
    model, x, chain = _calibration_chain(stages)
    executor = Checkpointed(
        model, x, chain=chain, schedule=store_all(chain), merge_graph_runs=False
    )
    return _extra_seconds(model, executor, x, rounds) / (2 * stages)


def measure_rebuild_seconds(
    blocks: int = CALIBRATION_BLOCKS, rounds: int = CALIBRATION_ROUNDS
) -> tuple[float, float]:
    """One measurement of what a unit rebuilt inside a graph run and each stage it rebuilds
    cost beyond their compute (seconds, each at least 0): a chain of small convolution,
    BatchNorm and ReLU stages checkpointed in segments of one block, then of three, each run as
    one graph, over plain autograd (less the real time of the forwards computed again), solved
    for the two costs."""
    torch.manual_seed(0)
    block = (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    model = nn.Sequential(*(copy.deepcopy(m) for _ in range(blocks) for m in block))
    x = torch.randn(2, 4, 8, 8)
    chain = replace(analytic_chain(model, x), autograd_peak_bytes=None)
    with torch.no_grad():
        forward = _median_seconds(lambda: model(x), rounds) / chain.length
    rows = []
    for segments in (blocks, blocks // 3):
        executor = Checkpointed(model, x, chain=chain, schedule=sequential(chain, segments))
        run = executor._as_run
        extra = _extra_seconds(model, executor, x, rounds) - forward * run.rebuilt_stages
        rows.append((run.rebuilds, run.rebuilt_stages, extra))
    (u1, s1, e1), (u2, s2, e2) = rows
    determinant = u1 * s2 - u2 * s1
    unit = (e1 * s2 - e2 * s1) / determinant if determinant else 0.0
    stage = (u1 * e2 - u2 * e1) / determinant if determinant else e1 / max(s1, 1)
    if unit < 0 or stage < 0:  # noise: the first measure's cost all per unit
        unit, stage = max(e1, 0.0) / max(u1, 1), 0.0
    return unit, stage


def _calibration_chain(stages: int) -> tuple[nn.Sequential, torch.Tensor, Chain]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(stages)))
    x = torch.randn(2, 4)
    return model, x, replace(analytic_chain(model, x), autograd_peak_bytes=None)


def _median_seconds(work: Any, rounds: int) -> float:
    """The median process CPU time of ``work()`` over ``rounds`` runs (after two to warm up)."""
    samples = []
    for round_ in range(rounds + 2):
        start = time.process_time()
        work()
        if round_ >= 2:
            samples.append(time.process_time() - start)
    return statistics.median(samples)


def _extra_seconds(model: nn.Module, executor: nn.Module, x: torch.Tensor, rounds: int) -> float:
    """The median, over paired rounds, of ``executor``'s step's process CPU time less
    ``model``'s (at least 0)."""

    def step(net: torch.nn.Module) -> float:
        start = time.process_time()
        net(x).sum().backward()
        seconds = time.process_time() - start
        model.zero_grad()
        return seconds

    differences = []
    for round_ in range(rounds + 2):
        plain, staged = step(model), step(executor)
        if round_ >= 2:  # the first rounds warm up
            differences.append(staged - plain)
    return max(0.0, statistics.median(differences))
