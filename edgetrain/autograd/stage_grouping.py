"""What a stage is: the children of an ``nn.Sequential`` grouped into stages.

A stage is normally one child; a child that returns a view of its input (``Flatten``) or
overwrites it in place (``ReLU(inplace=True)``) is merged into the stage before it, because a
stage's input must stay intact for recomputation and its output must be a tensor of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from edgetrain.autograd.stages import empty_like, leaves, module_key, run_forward, signature
from edgetrain.autograd.storage_counter import storage_key
from edgetrain.errors import InvalidInput


def group_children(model: nn.Sequential, sample: Any) -> list[tuple[str, nn.Module, int]]:
    """Split ``model`` into stages: ``(name, module, number of children)`` in order.

    Every entry of the ``nn.Sequential`` counts, a module listed twice included. Runs the children
    once without grad on ``sample`` to find those that return a view of their input or modify it
    in place; each is merged into the stage before it. The caller restores any state (BatchNorm
    statistics) this forward changes.
    """
    children = list(model._modules.items())
    groups: list[list[tuple[str, nn.Module]]] = []
    group_input: set[int] = set()
    open_group = False  # the current stage so far returns a view of its own input
    x = _detached(sample)
    seen: dict[tuple[str, str], tuple[bool, bool, Any]] = {}
    for index, (name, child) in enumerate(children):
        assert child is not None
        key = (module_key(child), signature(x))
        on_meta = all(t.device.type == "meta" for t in leaves(x))
        if on_meta and key in seen:
            # Shapes alone decide the outcome on meta tensors: reuse an identical child's
            # (only when it made a new tensor: a view must be made from this input).
            in_place, aliased, like = seen[key]
            out = empty_like(like)
        else:
            versions = [t._version for t in leaves(x)]
            try:
                out = run_forward(child, x, stage=index, name=name)
            except (RuntimeError, ValueError, TypeError) as exc:
                # The first run of the user's model on the user's sample: a failure here is a
                # mismatch between them (sizes that do not chain, dtypes, devices).
                first = str(exc).strip().splitlines()[0]
                raise InvalidInput(
                    f"layer {index} ({name}) fails on an input of {signature(x)}: {first}; "
                    "check that the layers' sizes and dtypes chain"
                ) from exc
            in_place = [t._version for t in leaves(x)] != versions
            # A view of the input (not a tensor passed through whole, as a skip is).
            passed = {id(t) for t in leaves(x)}
            aliased = bool(
                {storage_key(t) for t in leaves(out) if id(t) not in passed} & _storages(x)
            )
            if not (in_place or aliased):
                seen[key] = (in_place, aliased, out)
        if groups and (in_place or aliased or open_group):
            groups[-1].append((name, child))
        elif in_place:
            raise InvalidInput(
                f"the first layer ({name}) overwrites the model's input in place; "
                "construct it with inplace=False"
            )
        else:
            groups.append([(name, child)])
            group_input = _storages(x)
        passed = {id(t) for t in leaves(x)}
        open_group = bool(
            {storage_key(t) for t in leaves(out) if id(t) not in passed} & group_input
        )
        x = out
    if open_group and len(groups) > 1:
        groups[-2].extend(groups.pop())
    result: list[tuple[str, nn.Module, int]] = []
    for group in groups:
        if len(group) == 1:
            result.append((group[0][0], group[0][1], 1))
        else:
            names = "+".join(n for n, _ in group)
            result.append((names, nn.Sequential(*(m for _, m in group)), len(group)))
    return result


def _storages(value: Any) -> set[int]:
    return {storage_key(t) for t in leaves(value)}


def _detached(value: Any) -> Any:
    flat, spec = tree_flatten(value)
    return tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in flat], spec)
