"""What is held at a plan's predicted peak, by category, and the operation where it happens.

:func:`explain_plan` replays a plan with the one simulator
(:func:`edgetrain.core.simulator.simulate`'s
replay, stopped just before the operation at the peak:
:func:`~edgetrain.core.simulator.replay_state`)
and splits what it holds there into categories:

==========================  ===============================================================
``weights``, ``buffers``,   held before the step starts (the fixed part: given by the
``input``, ``gradients``,   caller; ``gradients`` only in a loop that keeps them,
``optimizer state``,        ``optimizer state`` / ``reserve`` as the caller counts them)
``reserve``
``checkpoint``              an activation the plan holds (by stage: ``a[k]``, stage k's input)
``output``                  the model's output, which the caller holds for the loss
``kept graph``              what autograd saved for a stage's backward (by stage), and the
                            buffer copies a recomputed stage's graph holds
``activation gradients``    the gradient flowing back (and the output's, held to the end)
``parameter gradients``     parameter gradients the backward has created so far
``retained``, ``buffer      what a stage keeps past its run; the buffer snapshot of a stage
snapshot``                  run more than once
``page-out being written``  an activation a page-out is still writing
``running``                 the stage running at the peak: its output, its graph and the
                            transient memory of its kernels (the operation's own peak)
==========================  ===============================================================

Every category but the fixed ones is counted by the replay, so the step's parts add up to the
plan's ``peak_bytes`` exactly (a store-all plan whose step was measured as plain autograd's
differs from its replay by ``measured beyond the replay``).
:meth:`edgetrain.Checkpointed.explain` adds the measured bytes of a step beside the predicted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import ReplayState, memory_trace, replay_state, simulate
from edgetrain.units import format_bytes

FIXED = ("weights", "buffers", "input", "gradients", "optimizer state", "reserve")
"""The categories held before the step starts, in the order tables show them."""
STEP = (
    "checkpoint",
    "output",
    "kept graph",
    "activation gradients",
    "parameter gradients",
    "retained",
    "buffer snapshot",
    "page-out being written",
    "running",
    "measured beyond the replay",
)
"""The categories the step holds above its start, in the order tables show them."""
UNSPLIT = "the step (not split)"
"""The measured category of a step run as the module itself or one graph (no operations)."""


@dataclass(frozen=True)
class PeakPart:
    """Bytes of one category (and stage, where one stage holds them) at the peak."""

    category: str
    stage: int | None
    bytes: int


@dataclass(frozen=True)
class PeakExplanation:
    """What is held at a plan's predicted peak, and where the peak is.

    Attributes:
        peak_bytes: the whole step's predicted peak: the fixed parts plus the plan's peak.
        operation: the operation at the peak (``"B12"``: stage 12's backward); ``position``:
            its index in the plan; ``phase``: "forward" or "backward".
        stage_name: the name of the stage that operation runs.
        parts: the bytes by category and stage (see the module docstring), the fixed ones first.
        grads_exist: the training loop planned for (gradients kept from the last step or not).
        plain_peak_bytes: plain autograd's predicted peak of the whole step, for comparison.
        measured_peak_bytes: a measured step's peak (the fixed parts plus the step's), if any.
        heap_peak_bytes: a measured step's heap peak above its start
        (:mod:`edgetrain.autograd.heap`):
            beyond its tensor peak, the scratch kernels allocate (the plan counts it as
            measured when the stages were profiled: ``Cost.heap_peak_bytes``).
        measured: a measured step's bytes by category at the same operation (see
            :mod:`edgetrain.runtime.peak_probe`; ``kept graph`` there is what the step held beyond
            the
            executor's own references, the caller's loss included); empty if not measured.
        stage_names: the name of every stage of the plan, to label ``parts``.
    """

    peak_bytes: int
    operation: str
    position: int
    phase: str
    stage_name: str
    parts: tuple[PeakPart, ...]
    grads_exist: bool
    plain_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    measured: Mapping[str, int] = field(default_factory=dict)
    heap_peak_bytes: int | None = None
    stage_names: tuple[str, ...] = field(default=(), repr=False)

    def by_category(self) -> dict[str, int]:
        """Predicted bytes per category (stages summed), in table order, zeros left out."""
        out: dict[str, int] = {}
        for part in self.parts:
            out[part.category] = out.get(part.category, 0) + part.bytes
        return {name: out[name] for name in (*FIXED, *STEP) if out.get(name)}

    def rows(self) -> list[tuple[str, int, int | None]]:
        """(what, predicted bytes, measured bytes or None): one row per category, a stage's
        own row for each stage holding at least a tenth of its category."""
        rows: list[tuple[str, int, int | None]] = []
        predicted = self.by_category()
        extra = [k for k, v in self.measured.items() if v and k not in predicted]
        names = [*predicted, *extra]
        for name in names:
            total = predicted.get(name, 0)
            rows.append((name, total, self.measured.get(name)))
            staged = [p for p in self.parts if p.category == name and p.stage is not None]
            for part in sorted(staged, key=lambda p: -p.bytes):
                if part.bytes * 10 >= total:
                    rows.append((f"  {self._label(part.stage)}", part.bytes, None))
        return rows

    def _label(self, stage: int | None) -> str:
        if stage is None:
            return ""
        name = self.stage_names[stage] if stage < len(self.stage_names) else ""
        return f"stage {stage} ({name})" if name else f"stage {stage}"

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: sizes in bytes."""
        return {
            "peak_bytes": self.peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "plain_peak_bytes": self.plain_peak_bytes,
            "operation": self.operation,
            "position": self.position,
            "phase": self.phase,
            "stage_name": self.stage_name,
            "grads_exist": self.grads_exist,
            "by_category": self.by_category(),
            "measured_by_category": dict(self.measured) or None,
            "heap_peak_bytes": self.heap_peak_bytes,
            "parts": [
                {"category": p.category, "stage": p.stage, "bytes": p.bytes} for p in self.parts
            ],
        }

    def __str__(self) -> str:
        measured = self.measured_peak_bytes is not None
        loop = "gradients kept" if self.grads_exist else "gradients set to None (zero_grad())"
        lines = [
            f"peak {format_bytes(self.peak_bytes)} at {self.operation}: stage {self.stage_name} "
            f"in the {self.phase} phase; loop: {loop}",
        ]
        width = max([len(r[0]) for r in self.rows()] + [10])
        head = f"  {'held':<{width}}  {'predicted':>12}" + (
            f"  {'measured':>12}" if measured else ""
        )
        lines.append(head)
        for what, predicted, got in self.rows():
            cell = "" if got is None else format_bytes(got)
            tail = f"  {cell:>12}" if measured else ""
            lines.append(f"  {what:<{width}}  {format_bytes(predicted):>12}{tail}")
        total = f"  {'total':<{width}}  {format_bytes(self.peak_bytes):>12}"
        if measured:
            total += f"  {format_bytes(sum(self.measured.values())):>12}"
        lines.append(total)
        if measured:
            where = (
                "the step ran as plain autograd, measured whole"
                if UNSPLIT in self.measured
                else f"the column is what was held at {self.operation}"
            )
            lines.append(
                f"measured: the step's peak {format_bytes(self.measured_peak_bytes or 0)}; {where}"
            )
            step = self.measured_peak_bytes or 0
            step -= sum(v for k, v in self.measured.items() if k in FIXED)
            if self.heap_peak_bytes is not None and self.heap_peak_bytes > step:
                lines.append(
                    f"heap: the step's peak {format_bytes(self.heap_peak_bytes)} above its start, "
                    f"{format_bytes(self.heap_peak_bytes - step)} beyond its tensors (kernel "
                    "scratch, planned for as profiled, and the heap's own bookkeeping)"
                )
        if self.plain_peak_bytes is not None:
            saved = self.plain_peak_bytes - self.peak_bytes
            lines.append(
                f"plain autograd: {format_bytes(self.plain_peak_bytes)} "
                f"({'saves' if saved >= 0 else 'costs'} {format_bytes(abs(saved))})"
            )
        lines.extend(_why(self))
        return "\n".join(lines)


def _why(explanation: PeakExplanation) -> list[str]:
    """A sentence for the user who sees no saving: what dominates the peak."""
    step = {k: v for k, v in explanation.by_category().items() if k not in FIXED}
    fixed = sum(v for k, v in explanation.by_category().items() if k in FIXED)
    if not step:
        return []
    top, top_bytes = max(step.items(), key=lambda item: item[1])
    lines = []
    if fixed >= explanation.peak_bytes / 2:
        lines.append(
            f"the fixed part ({format_bytes(fixed)}) is most of the peak: checkpointing saves "
            "only activations"
        )
    if top in ("parameter gradients", "running", "output", "activation gradients"):
        lines.append(
            f"the largest part of the step is {top} ({format_bytes(top_bytes)}): no plan over "
            "these stages holds less of it"
        )
    return lines


def explain_plan(
    chain: Chain,
    schedule: Schedule,
    *,
    grads_exist: bool = False,
    fixed: Mapping[str, int] | None = None,
    plain_peak_bytes: int | None = None,
) -> PeakExplanation:
    """What ``schedule`` holds on ``chain`` at its predicted peak, by category and stage.

    ``fixed``: the bytes held before the step, by category (see :data:`FIXED`); they add to the
    plan's peak. The step's categories add up to ``simulate(chain, schedule).peak_bytes``.
    """
    cost = simulate(chain, schedule, grads_exist=grads_exist)
    position = cost.peak_op
    kind, k = list(schedule)[position]
    state = replay_state(chain, schedule, position, grads_exist=grads_exist)
    parts = [PeakPart(name, None, int(value)) for name, value in (fixed or {}).items() if value]
    held = step_parts(chain, state, grads_exist=grads_exist)
    if kind is Op.BACKWARD and not state.in_backward:
        held.append(
            PeakPart("activation gradients", None, chain.gradient_of_activation_bytes(chain.length))
        )
    trace = memory_trace(chain, schedule, grads_exist=grads_exist)
    running = trace[position][1] - sum(p.bytes for p in held)
    stage = None if kind.names_activation else k
    held.append(PeakPart("running", stage, running))
    beyond = cost.peak_bytes - trace[position][1]
    if beyond:
        held.append(PeakPart("measured beyond the replay", None, beyond))
    parts += _merged(held)
    names = tuple(s.name for s in chain.stages)
    fixed_total = sum((fixed or {}).values())
    return PeakExplanation(
        peak_bytes=fixed_total + cost.peak_bytes,
        operation=f"{kind.code}{k}",
        position=position,
        phase="forward" if position < schedule.forward_phase_end else "backward",
        stage_name=names[k] if not kind.names_activation and k < len(names) else f"a[{k}]",
        parts=tuple(parts),
        grads_exist=grads_exist,
        plain_peak_bytes=None if plain_peak_bytes is None else fixed_total + plain_peak_bytes,
        stage_names=names,
    )


def step_parts(chain: Chain, state: ReplayState, *, grads_exist: bool) -> list[PeakPart]:
    """What the replay holds in ``state`` (before an operation), by category and stage; the
    parts add up to ``state.held_bytes``."""
    n = chain.length
    parts: list[PeakPart] = []
    owner: dict[int, tuple[str, int | None]] = {}
    for piece in state.pieces[n]:
        owner.setdefault(piece, ("output", None))
    for k in range(1, n):
        if state.plain[k]:
            for piece in state.pieces[k]:
                owner.setdefault(piece, ("checkpoint", k))
    for k in range(n):
        if state.graph[k]:
            for piece in state.graph_pieces[k]:
                owner.setdefault(piece, ("kept graph", k))
    for piece, refs in enumerate(state.refs):
        if refs and piece and state.sizes[piece]:
            category, index = owner.get(piece, ("kept graph", None))
            parts.append(PeakPart(category, index, state.sizes[piece]))
    for k, stage in enumerate(chain.stages):
        if state.graph[k]:
            parts.append(PeakPart("kept graph", k, stage.saved_bytes + state.copies[k]))
        if state.ran[k] and stage.retained_bytes:
            parts.append(PeakPart("retained", k, stage.retained_bytes))
        if state.snapshot_bytes[k]:
            parts.append(PeakPart("buffer snapshot", k, state.snapshot_bytes[k]))
    if state.in_backward:
        flowing = state.next_backward + 1
        gradient = chain.gradient_of_activation_bytes(n)
        if flowing < n:
            gradient += chain.gradient_of_activation_bytes(flowing)
        parts.append(PeakPart("activation gradients", None, gradient))
        for k in range(flowing, n):
            made = chain.stages[k].made_gradient_bytes(grads_exist)
            if made:
                parts.append(PeakPart("parameter gradients", k, made))
    if state.writing_bytes:
        parts.append(PeakPart("page-out being written", None, state.writing_bytes))
    return parts


def _merged(parts: list[PeakPart]) -> list[PeakPart]:
    """One part per (category, stage), in table order, zero parts left out."""
    sums: dict[tuple[str, int | None], int] = {}
    for part in parts:
        key = (part.category, part.stage)
        sums[key] = sums.get(key, 0) + part.bytes
    order = {name: i for i, name in enumerate((*FIXED, *STEP))}
    keys = sorted(sums, key=lambda key: (order[key[0]], -1 if key[1] is None else key[1]))
    return [PeakPart(c, s, sums[(c, s)]) for c, s in keys if sums[(c, s)]]
