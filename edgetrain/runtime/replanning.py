"""When a step plans again: the state a plan is made for (:meth:`Replanning._state`), the plans
kept for states a step may come back to, planning for a step in a new state, and what changed
between the state a plan was made for and a step's, in words."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch.utils._python_dispatch import _disable_current_modes

from edgetrain.autograd.replay import autocast_state
from edgetrain.autograd.stages import leaves, shapes, signature
from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Schedule
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.frontend.cuts import as_stages
from edgetrain.runtime.interpreter import gradients_kept

KEPT_PLANS = 16
"""Plans :class:`Checkpointed` keeps for states it may come back to (a value ``forward()`` reads
that changes every step plans every step; pass such a value as a tensor instead)."""


def autocast_mismatch(measured: tuple[str, ...], now: tuple[str, ...]) -> str:
    """Why a given chain cannot plan this step: it was measured in another autocast state."""

    def state(label: tuple[str, ...]) -> str:
        return f"under torch.autocast({', '.join(label)})" if label else "without torch.autocast"

    return (
        f"chain= was measured {state(measured)} but Checkpointed is built {state(now)}, where "
        "the step holds other dtypes and sizes; build it in the state the chain was measured "
        "in (a step in another autocast state then plans for that state), or pass no chain="
    )


def describe_change(planned: tuple[Any, ...], now: tuple[Any, ...], shapes: str) -> str:
    """What differs between two :meth:`Checkpointed._state` keys, in words (``shapes``: the
    input's then and now)."""
    changes = [
        what
        for what, a, b in zip(
            (
                f"an input of {shapes}",
                "another input needing a gradient",
                "other parameters needing gradients (frozen or unfrozen layers)",
                "another train/eval mode",
                "another torch.autocast state",
                "another value of a module attribute (fx traced the old one into the stages)",
                "a training loop that keeps gradients between steps"
                if now[-1]
                else "a training loop that sets gradients to None (zero_grad())",
            ),
            planned,
            now,
            strict=True,
        )
        if a != b
    ]
    return ", ".join(changes)


class Replanning:
    """How :class:`~edgetrain.runtime.checkpointed.Checkpointed` plans for the state a step is
    in: each plan made is kept (a :class:`~edgetrain.runtime.prepared.PreparedPlan`) by the
    state it was made for, at most :data:`KEPT_PLANS`, and made current again when a step comes
    back to that state."""

    def _plan(
        self, sample: Any, chain: Chain | None, schedule: Schedule | None, as_is: bool = False
    ) -> None:
        """Plan (or adopt ``schedule``) for ``sample``, and remember the plan for its state
        (``as_is``: ``chain`` is this model's as profiled, nothing to measure again). The other
        training loop is planned for when a step first runs in it, on the same profile: most
        loops never change, and planning a loop takes about as long as profiling the model."""
        self._make_plan(sample, chain, schedule, as_is)
        self._remember()
        if schedule is not None:  # a given plan runs in either loop
            other = (*self._key[:-1], not self._key[-1])
            self._plans[other] = replace(self._plans[self._key], key=other)

    def _remember(self) -> None:
        self._plans[self._key] = self._prepared()
        while len(self._plans) > KEPT_PLANS:  # the oldest first; the one just made stays
            del self._plans[next(iter(self._plans))]

    def _state(self, x: Any) -> tuple[Any, ...]:
        """What a plan is made for besides the model: the input's shapes and dtypes, which
        input tensors and parameters need a gradient, each module's train/eval mode (the chain
        records what needs a gradient, and a Dropout in eval mode was profiled as the
        identity), the autocast state (under ``torch.autocast`` the stages are profiled
        under it: other dtypes, other sizes, the weights' copies), and for a captured model
        the plain Python attributes its ``forward()`` read while traced
        (:attr:`~edgetrain.frontend.fx_capture.Captured.reads`: fx traced their values in, so a
        temperature
        annealed after planning would otherwise stay the old one; an attribute forward() does
        not read, a step counter the loop keeps on the model, plans nothing again), and
        whether the loop keeps gradients between steps (what a step starts with, see
        :attr:`fixed_bytes`, and what its backward creates differ)."""
        return (
            shapes(x),
            tuple(t.requires_grad for t in leaves(x)),
            tuple(p.requires_grad for p in self._params),
            tuple(m.training for m in self.module.modules()),
            tuple(autocast_state()),
            tuple(getattr(m, name, None) for m, name in getattr(self.model, "traced_reads", ())),
            gradients_kept(p for p in self._params if p.requires_grad),
        )

    def _plan_for(self, x: Any, key: tuple[Any, ...], given: dict[str, Any] | None) -> None:
        """Make the plan for the state ``key`` of a step on ``x`` (see :meth:`_state`) the
        current one: restored as it was if planned for before, else planned now (or refused
        with ``on_new_shape="error"``)."""
        shapes_now = f"{signature(x)}, planned for an input of {self._signature}"
        known = self._plans.get(key)
        if known is not None:  # a state planned for before
            self._use(known)
            self._unplanned = False
            return
        # A state planned for in the other training loop: the same chain, planned for this
        # loop (nothing captured, profiled or measured again; not a new state to refuse).
        sibling = self._plans.get((*key[:-1], not key[-1]))
        loop_only = sibling is not None
        if self.on_new_shape == "error" and not loop_only:
            raise InvalidInput(
                f"Checkpointed was planned for another state than this step's "
                f"({describe_change(self._key, key, shapes_now)}); plan for it (or pass "
                "on_new_shape='replan')"
            )
        planned, change = self._key, describe_change(self._key, key, shapes_now)
        if sibling is not None:
            self._use(sibling)
        elif self.model is not self.module:
            self.model = as_stages(
                self.module, x if given is None else given, leaf_modules=self.leaf_modules
            )
            self._params = list(self.model.parameters())
        self._unplanned = True  # until this plan is made: half planned, every call plans
        try:
            # Planning is not the step's: a dispatch mode measuring the step (a tensor counter)
            # does not see it.
            with _disable_current_modes():
                self._plan(x, self.chain if loop_only else None, None, as_is=loop_only)
        except InfeasibleBudget as exc:
            self._key = planned
            raise InfeasibleBudget(f"planning again for {change}: {exc}", exc.smallest) from exc
        self._unplanned = False
