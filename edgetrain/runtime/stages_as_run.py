"""The model's stages as the executor runs them: the chain's stages cut out of the model, runs
of them merged into one graph, and whether a run owns its parameters."""

from __future__ import annotations

from torch import nn

from edgetrain.autograd.replay import (
    GraphRunModule,
)
from edgetrain.autograd.stage_state import StageParams
from edgetrain.core.chain import Chain
from edgetrain.core.graph_merge import GraphRun
from edgetrain.errors import InvalidInput


def stage_modules(model: nn.Sequential, chain: Chain) -> list[nn.Module]:
    children = [m for m in model._modules.values() if m is not None]
    if sum(stage.span for stage in chain.stages) != len(children):
        raise InvalidInput(
            f"the chain covers {sum(s.span for s in chain.stages)} children but the model has "
            f"{len(children)}; profile this model again"
        )
    modules: list[nn.Module] = []
    start = 0
    for stage in chain.stages:
        part = children[start : start + stage.span]
        modules.append(part[0] if stage.span == 1 else nn.Sequential(*part))
        start += stage.span
    return modules


def own_params(params: list[StageParams], run: GraphRun) -> bool:
    """Whether no stage outside ``run`` uses a trainable parameter of its stages. Autograd sums
    a parameter's gradients from the uses inside one graph before handing them on; with a use
    outside the run too, the sum would be taken in another order than plain autograd's (which
    sums them all, then adds to ``.grad``), and the gradient would differ in its last bits."""
    inside = {index for stage in params[run.first : run.last + 1] for index, _ in stage.params}
    return not any(
        index in inside
        for k, stage in enumerate(params)
        if not run.first <= k <= run.last
        for index, _ in stage.params
    )


def modules_as_run(
    stages: list[nn.Module], runs: list[GraphRun], snapshotted: set[int]
) -> list[nn.Module]:
    """The stages as the executor runs them: each of ``runs`` one stage (a
    :class:`~edgetrain.autograd.replay.GraphRunModule`; of its stages, those in ``snapshotted`` are
    rebuilt from a snapshot of their buffers), the others as they are (see
    :func:`~edgetrain.core.graph_merge.merged_schedule`)."""
    merged = {run.first: run for run in runs}
    modules: list[nn.Module] = []
    k = 0
    while k < len(stages):
        run = merged.get(k)
        if run is None:
            modules.append(stages[k])
            k += 1
            continue
        recomputed = frozenset(j - run.first for j in run.recomputed)
        segments = frozenset((i - run.first, j - run.first) for i, j in run.checkpointed)
        snapshots = frozenset(j - run.first for j in snapshotted if run.first <= j <= run.last)
        modules.append(
            GraphRunModule(stages[run.first : run.last + 1], recomputed, segments, snapshots)
        )
        k = run.last + 1
    return modules
