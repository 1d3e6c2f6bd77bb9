"""How a stage runs: the primitives shared by the profiler and the executor.

Profiling and execution must run a stage the same way, or the measured costs would not predict
the run: both go through :func:`run_forward` and :func:`run_backward`.
:func:`group_children` decides what a stage is: normally one child of the ``nn.Sequential``; a
child that returns a view of its input (``Flatten``) or overwrites it in place
(``ReLU(inplace=True)``) is merged into the stage before it, because a stage's input must stay
intact for recomputation and its output must be a tensor of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.measure import storage_key


def run_forward(
    module: nn.Module, x: torch.Tensor, *, stage: int = 0, name: str = ""
) -> torch.Tensor:
    """Run one stage without building a graph; returns its output."""
    with torch.no_grad():
        out = module(x)
    _check_output(out, stage, name)
    return out


def run_forward_with_grad(
    module: nn.Module,
    x: torch.Tensor,
    *,
    needs_input_grad: bool,
    stage: int = 0,
    name: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one stage on a detached leaf (requiring grad if ``needs_input_grad``), building its
    graph; returns ``(leaf, output)``, ready for :func:`run_backward`."""
    leaf = x.detach().requires_grad_(needs_input_grad)
    with torch.enable_grad():
        out = module(leaf)
    _check_output(out, stage, name)
    return leaf, out


def run_backward(
    leaf: torch.Tensor, output: torch.Tensor, grad_output: torch.Tensor
) -> torch.Tensor | None:
    """Backpropagate ``grad_output`` through a stage's graph; returns the input's gradient.

    Parameter gradients accumulate into ``.grad`` as usual.
    """
    torch.autograd.backward(output, grad_output)
    return leaf.grad if leaf.requires_grad else None


def _check_output(out: object, stage: int, name: str) -> None:
    if not isinstance(out, torch.Tensor):
        raise InvalidInput(
            f"stage {stage} ({name}) returns {type(out).__name__}, not a tensor; "
            "edgetrain chains stages that each return one tensor"
        )


def group_children(model: nn.Sequential, sample: torch.Tensor) -> list[tuple[str, nn.Module, int]]:
    """Split ``model`` into stages: ``(name, module, number of children)`` in order.

    Runs the children once without grad on ``sample`` to find those that return a view of their
    input or modify it in place; each is merged into the stage before it. The caller restores
    any state (BatchNorm statistics) this forward changes.
    """
    children = list(model.named_children())
    groups: list[list[tuple[str, nn.Module]]] = []
    group_input = -1
    open_group = False  # the current stage so far returns a view of its own input
    x = sample.detach()
    seen: dict[tuple[str, tuple[int, ...], torch.dtype], tuple[bool, bool, torch.Tensor]] = {}
    for index, (name, child) in enumerate(children):
        key = (repr(child), tuple(x.shape), x.dtype)
        if x.device.type == "meta" and key in seen:
            # Shapes alone decide the outcome on meta tensors: reuse an identical child's.
            in_place, aliased, like = seen[key]
            out = x if aliased else torch.empty_like(like)
        else:
            version = x._version
            try:
                out = run_forward(child, x, stage=index, name=name)
            except (RuntimeError, ValueError) as exc:
                # The first run of the user's model on the user's sample: a failure here is a
                # mismatch between them (sizes that do not chain, dtypes, devices).
                first = str(exc).strip().splitlines()[0]
                raise InvalidInput(
                    f"layer {index} ({name}) fails on an input of shape {tuple(x.shape)} "
                    f"({x.dtype}): {first}; check that the layers' sizes and dtypes chain"
                ) from exc
            in_place = x._version != version
            aliased = storage_key(out) == storage_key(x)
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
            group_input = storage_key(x)
        open_group = storage_key(out) == group_input
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
