"""The caller's loss in the plan: a chain whose last stage also computes the loss, so that a
plan's predicted peak is the whole training step's, loss included. Pure."""

from __future__ import annotations

from dataclasses import replace

from edgetrain.core.chain import Chain, Stage
from edgetrain.errors import InvalidInput


def with_loss(chain: Chain, loss: Stage) -> Chain:
    """``chain`` whose last stage also computes the caller's loss (``loss``: the loss profiled
    as a one-stage chain on a leaf of the output's shape), for planning the whole step.

    The loss runs between the forward phase and the backward phase, on top of what the plan
    holds when the forward ends, not at the chain's peak; and the forward's output and its
    gradient are already counted by :func:`~edgetrain.core.simulator.simulate` (the caller holds the
    output, the output's gradient is held until the backward ends), so the loss cannot be a
    reserve subtracted from the budget without counting it wrongly. Merged into the last stage
    (not appended as a stage of its own, which would let a plan run the last stage without
    grad, compute the loss, and build the last stage's graph afterwards: the caller's step
    cannot), the plan's ops are the same for both chains, and on this chain its predicted peak
    is what the step holds, loss included (``StorageCounter`` agrees to the byte on TinyLM and
    MobileNetV2):

    * forward: the output (``O`` bytes) and the last stage's graph, then the loss's forward on
      top; the graph keeps the output when the loss saves its input (a square does);
    * backward: the loss's backward (its peak includes the output's gradient it leaves), which
      frees the output if only the loss held it, then the last stage's backward on top of the
      output's gradient; that gradient is held until the backward ends, as the parameter
      gradients are (counted with them: plans for steps whose gradients start as None).
    """
    last = chain.stages[-1]
    if last.leaf_bytes or any(j >= 0 for j in last.gradient_from):
        raise InvalidInput(
            f"{chain.name}: the last stage's output is not one tensor of its own; a loss can be "
            "merged only into a stage that returns one tensor"
        )
    out = last.output_bytes
    out_grad = out if loss.input_gradient_bytes is None else loss.input_gradient_bytes
    graph_keeps = loss.saves_input or last.saves_output
    freed_by_loss = out if loss.saves_input and not last.saves_output else 0
    merged = replace(
        last,
        name=f"{last.name}+loss",
        output_bytes=loss.output_bytes,
        saved_bytes=last.saved_bytes + (out if graph_keeps else 0),
        saves_output=False,
        saved_outputs=None,
        forward_peak_bytes=max(last.forward_peak_bytes, out + loss.forward_peak_bytes),
        forward_grad_peak_bytes=max(
            last.forward_grad_peak_bytes, out + last.saved_bytes + loss.forward_grad_peak_bytes
        ),
        backward_peak_bytes=max(
            loss.backward_peak_bytes, out_grad - freed_by_loss + last.backward_peak_bytes
        ),
        backward_peak_kept_bytes=None,
        gradient_bytes=last.gradient_bytes + out_grad,
        forward_seconds=last.forward_seconds + loss.forward_seconds,
        backward_seconds=last.backward_seconds + loss.backward_seconds,
        forward_scratch_bytes=max(last.forward_scratch_bytes, loss.forward_scratch_bytes),
        backward_scratch_bytes=max(last.backward_scratch_bytes, loss.backward_scratch_bytes),
    )
    stages = (*chain.stages[:-1], merged)
    return Chain(stages, chain.input_bytes, chain.input_requires_grad, f"{chain.name}+loss")
