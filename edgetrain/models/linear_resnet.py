"""LinearResNet-x: the paper's homogeneous stand-in for ResNet-x (§VI of Kukreja et al. 2019).

A chain of ``x`` equal layers whose weights add up to ResNet-x's weights and whose activations add
up to ResNet-x's activations: each layer holds (total activation bytes of ResNet-x) / x. Forward and
backward of every layer cost one unit of time each, so the recompute factor of a schedule on it is
the paper's count "2ρl forward and backward computations". It is pure data (a :class:`Chain`):
the paper never runs it, and neither does edgetrain.
"""

from __future__ import annotations

from edgetrain.chain import Chain, Stage


def linear_resnet_chain(
    depth: int, weight_bytes: int, activation_bytes: int, *, name: str | None = None
) -> Chain:
    """A homogeneous chain of ``depth`` layers.

    ``weight_bytes``: all parameters of ResNet-``depth`` (bytes). ``activation_bytes``: all
    activations of one training batch of ResNet-``depth`` (bytes). Each layer's output is
    ``activation_bytes // depth``; autograd keeps exactly the layer's input (nothing else), a
    forward
    allocates its output, a backward allocates the input gradient; one time unit per pass.
    """
    per_layer = activation_bytes // depth
    per_weight = weight_bytes // depth
    stage = Stage(
        name="layer",
        output_bytes=per_layer,
        saved_bytes=0,
        saves_input=True,
        forward_peak_bytes=per_layer,
        forward_grad_peak_bytes=per_layer,
        backward_peak_bytes=per_layer,
        weight_bytes=per_weight,
        gradient_bytes=per_weight,
        forward_seconds=1.0,
        backward_seconds=1.0,
        layer_output_bytes=per_layer,
    )
    stages = tuple(stage.renamed(f"layer{i}") for i in range(depth))
    return Chain(stages=stages, input_bytes=per_layer, name=name or f"linear_resnet{depth}")
