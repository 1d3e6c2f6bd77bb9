"""LinearResNet-x: the paper's homogeneous stand-in for ResNet-x (§VI of Kukreja et al. 2019).

A chain of ``x`` equal layers whose weights add up to ResNet-x's weights and whose activations add
up to ResNet-x's activations: each layer holds (total activation bytes of ResNet-x) / x. Forward and
backward of every layer cost one unit of time each, so the recompute factor of a schedule on it is
the paper's count "2ρl forward and backward computations". It is pure data (a :class:`Chain`):
the paper never runs it, and neither does edgetrain.
"""

from __future__ import annotations

from edgetrain.core.chain import Chain, uniform_chain


def linear_resnet_chain(
    depth: int, weight_bytes: int, activation_bytes: int, *, name: str | None = None
) -> Chain:
    """A homogeneous chain of ``depth`` layers (see :func:`edgetrain.core.chain.uniform_chain`).

    ``weight_bytes``: all parameters of ResNet-``depth`` (bytes). ``activation_bytes``: all
    activations of one training batch of ResNet-``depth`` (bytes). Each layer outputs
    ``activation_bytes // depth`` and holds ``weight_bytes // depth``; one time unit per pass.
    """
    return uniform_chain(
        depth,
        activation_bytes // depth,
        weight_bytes=weight_bytes // depth,
        name=name or f"linear_resnet{depth}",
    )
