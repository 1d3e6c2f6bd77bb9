"""What a step can be refused for before any profile, from the model's sizes alone: a budget
below its weights, buffers and input (with the smallest budget that plans, read off the chain from
shapes), and a plan made for another model."""

from __future__ import annotations

from typing import Any

from torch import nn

from edgetrain.autograd.stages import (
    leaves,
)
from edgetrain.autograd.storage_counter import storage_bytes
from edgetrain.core.accounting import fixed_training_bytes
from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Schedule
from edgetrain.errors import EdgetrainError, InfeasibleBudget, InvalidInput, InvalidSchedule
from edgetrain.frontend.profiling import (
    analytic_chain,
)
from edgetrain.planners.search import plan_for_device
from edgetrain.runtime.interpreter import gradients_kept
from edgetrain.units import format_bytes, parse_bytes


def check_made_for(schedule: Schedule, chain: Chain) -> None:
    made_for = schedule.params.get("made_for")
    if not isinstance(made_for, dict):
        return  # a plan written by hand: simulate() checks that it runs on this chain
    if made_for.get("chain") != chain.fingerprint():
        raise InvalidSchedule(
            f"this plan was made for {made_for.get('model') or 'another model'} with an input of "
            f"{made_for.get('input_bytes')} bytes, not for {chain.name} with "
            f"{chain.input_bytes} (another model, batch, image size or dtype); re-plan it for "
            "this one"
        )


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters, a tied one counted once (as a chain counts them)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _input_bytes(sample: Any) -> int:
    return sum(t.numel() * t.element_size() for t in leaves(sample))


def check_budget_holds_weights(
    device_bytes: int,
    model: nn.Module,
    sample: Any,
    reserve_bytes: int = 0,
    strategy: str | None = None,
    chain: Chain | None = None,
) -> None:
    """InfeasibleBudget when ``device_bytes`` cannot hold the model's parameters, its buffers,
    the input and ``reserve_bytes``: counted from their sizes, before any profile (what every
    plan holds at least). With a ``strategy``, the error's smallest budget is the one that
    plans: ``chain`` when given, else the chain from shapes
    (:func:`~edgetrain.frontend.profiling.analytic_chain`, sized on meta tensors, in moments),
    planned as :class:`~edgetrain.runtime.checkpointed.Checkpointed` plans it, for the loop the
    model's gradients are in now. A profile can size a stage a little differently from its
    shapes; then the profiled step's own refusal names its smallest."""
    held = parameter_bytes(model) + sum(b.numel() * b.element_size() for b in model.buffers())
    floor = held + _input_bytes(sample) + reserve_bytes
    if device_bytes <= floor and strategy is not None:
        _refuse_with_the_smallest(device_bytes, model, sample, reserve_bytes, strategy, chain)
    if device_bytes <= floor:
        reserve = (
            f" and {format_bytes(reserve_bytes)} of optimizer state or reserve"
            if reserve_bytes
            else ""
        )
        raise InfeasibleBudget(
            f"{format_bytes(device_bytes)} does not hold the weights, buffers and input: the step "
            f"starts with {format_bytes(floor - reserve_bytes)}{reserve}, before any activation; "
            "give more memory",
            floor,
        )


def _refuse_with_the_smallest(
    device_bytes: int,
    model: nn.Module,
    sample: Any,
    reserve_bytes: int,
    strategy: str,
    chain: Chain | None,
) -> None:
    """Raise the planner's own InfeasibleBudget for ``device_bytes`` on the model's chain from
    shapes (its smallest plans); return when the chain cannot be made from shapes."""
    if chain is None:
        try:
            chain = analytic_chain(model, sample)
        except EdgetrainError:
            return  # not sizeable on meta tensors: the profile's check reports it
    grads_exist = gradients_kept(p for p in model.parameters() if p.requires_grad)
    grads = chain.gradient_bytes if grads_exist else 0
    fixed = fixed_training_bytes(chain) - chain.gradient_bytes + grads + reserve_bytes
    plan_for_device(
        chain, strategy, device_bytes=device_bytes, fixed_bytes=fixed, grads_exist=grads_exist
    )


def check_plan_for(schedule: Schedule, stages: nn.Module, sample: Any, name: str) -> None:
    """InvalidSchedule when ``schedule`` records that it was made for a model whose weights or
    input differ from ``stages`` (the model as stages, :func:`as_stages`) and ``sample``: from
    their sizes, before any profile. The chain's fingerprint, checked once the model is
    profiled, decides the rest."""
    made_for = schedule.params.get("made_for")
    if not isinstance(made_for, dict):
        return
    weights, given = parameter_bytes(stages), storage_bytes(leaves(sample))
    recorded = made_for.get("weight_bytes", weights), made_for.get("input_bytes", given)
    if recorded != (weights, given):
        raise InvalidSchedule(
            f"this plan was made for {made_for.get('model') or 'another model'} "
            f"({recorded[0]} bytes of weights, an input of {recorded[1]} bytes), not for {name} "
            f"({weights} bytes of weights, an input of {given} bytes); re-plan it for this one"
        )


def refuse_hooks(model: nn.Module) -> None:
    """InvalidInput when the wrapped model has hooks of its own (Checkpointed runs its stages,
    not its ``forward()``)."""
    hooks = (
        model._forward_hooks,
        model._forward_pre_hooks,
        model._backward_hooks,
        model._backward_pre_hooks,
    )
    if any(hooks):
        raise InvalidInput(
            "the wrapped nn.Sequential has hooks of its own, which Checkpointed would not run; "
            "register them on the Checkpointed module or on the model's children instead"
        )


BUDGET_RULES = ("min", "auto")
"""Budgets read off the frontier instead of given in bytes (see :class:`Checkpointed`)."""


def device_bytes(memory_budget: int | float | str) -> int:
    """A budget's bytes: 0 until planning reads a rule off the frontier."""
    if memory_budget in BUDGET_RULES:
        return 0
    return parse_bytes(memory_budget)
