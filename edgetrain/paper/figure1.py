"""Figure 1 of the paper: peak memory against the recompute factor for LinearResNet-18..152.

Each LinearResNet-x is the homogeneous chain of §VI built from ResNet-x's weights and layer
outputs (:mod:`edgetrain.paper.linear_resnet`) for 224² and 500² images at batch 1 and 8. Memory on
the y axis is the paper's fixed part (4 × weights: weights, gradients, two Adam buffers) plus the
plan's simulated activation peak. Curves: Revolve (the paper's method) and the optimal plan.

The paper states that at 500², batch 8, every model fits in 2 GB once ρ > 1.6. :func:`claim`
checks it under three accountings and says which ones make it hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgetrain import progress
from edgetrain.models import model_chain
from edgetrain.paper.linear_resnet import linear_resnet_chain
from edgetrain.planners.search import tradeoff

DEPTHS = (18, 34, 50, 101, 152)
SETTINGS = ((224, 1), (224, 8), (500, 1), (500, 8))  # (image, batch): panels a-d
DEVICE_BYTES = 2 * 2**30
"""The Waggle node's 2 GB of LPDDR3."""
CLAIM_RHO = 1.6


@dataclass(frozen=True)
class Curve:
    """One line of the figure: Pareto points (recompute factor, total peak bytes)."""

    depth: int
    image: int
    batch: int
    strategy: str
    weight_bytes: int
    points: tuple[tuple[float, int], ...]

    def memory_at(self, rho: float, fixed_bytes: int | None = None) -> int | None:
        """Least total memory of a plan with recompute factor <= ``rho`` (None if none).

        ``fixed_bytes`` replaces the default fixed part (4 × weights) when given.
        """
        fits = [peak for r, peak in self.points if r <= rho + 1e-9]
        if not fits:
            return None
        activations = min(fits) - 4 * self.weight_bytes
        fixed = 4 * self.weight_bytes if fixed_bytes is None else fixed_bytes
        return fixed + activations


def curves(strategies: tuple[str, ...] = ("revolve", "optimal")) -> list[Curve]:
    """Every curve of the figure (20 chains × strategies)."""
    out: list[Curve] = []
    with progress.task("figure 1 curves", total=len(SETTINGS) * len(DEPTHS)) as step:
        for image, batch in SETTINGS:
            for depth in DEPTHS:
                resnet = model_chain(f"resnet{depth}", batch, image, timing=False)
                for strategy in strategies:
                    out.append(
                        curve(
                            depth,
                            image,
                            batch,
                            strategy,
                            resnet.weight_bytes,
                            resnet.layer_output_bytes,
                        )
                    )
                step(detail=f"LinearResNet-{depth}, {image}x{image}, batch {batch}")
    return out


def curve(
    depth: int,
    image: int,
    batch: int,
    strategy: str,
    weight_bytes: int,
    activation_bytes: int,
) -> Curve:
    """The curve of LinearResNet-``depth`` built from ResNet-``depth``'s weights and layer
    outputs at that image size and batch: the Pareto frontier of ``strategy``'s plans, memory
    counted with 4 × weights. The fixed part holds the gradients, so the plans are those of
    the loop that keeps them (the step does not create them again)."""
    chain = linear_resnet_chain(depth, weight_bytes, activation_bytes)
    fixed = 4 * weight_bytes
    points = tuple((rho, fixed + peak) for rho, peak in tradeoff(chain, strategy, grads_exist=True))
    return Curve(depth, image, batch, strategy, weight_bytes, points)


@dataclass(frozen=True)
class ClaimRow:
    """Least total memory (bytes) at ρ <= 1.6, 500², batch 8, for one model."""

    depth: int
    revolve_4w: int | None
    optimal_4w: int | None
    optimal_1w: int | None


def claim(all_curves: list[Curve]) -> tuple[list[ClaimRow], dict[str, bool]]:
    """Check "every model fits in 2 GB for ρ > 1.6 at 500², batch 8" under three accountings.

    Returns the per-model rows and, per accounting, whether every model fits:
    ``revolve_4w`` (Revolve, 4 × weights), ``optimal_4w`` (optimal plan, 4 × weights) and
    ``optimal_1w`` (optimal plan, weights counted once as in §VI's n_max = (M_C - M_W)/(k M_A)).
    """
    rows = []
    for depth in DEPTHS:
        rev = _find(all_curves, depth, "revolve")
        opt = _find(all_curves, depth, "optimal")
        rows.append(
            ClaimRow(
                depth,
                rev.memory_at(CLAIM_RHO),
                opt.memory_at(CLAIM_RHO),
                opt.memory_at(CLAIM_RHO, fixed_bytes=opt.weight_bytes),
            )
        )

    def holds(values: list[int | None]) -> bool:
        return all(v is not None and v <= DEVICE_BYTES for v in values)

    verdict = {
        "revolve_4w": holds([r.revolve_4w for r in rows]),
        "optimal_4w": holds([r.optimal_4w for r in rows]),
        "optimal_1w": holds([r.optimal_1w for r in rows]),
    }
    return rows, verdict


def _find(all_curves: list[Curve], depth: int, strategy: str) -> Curve:
    for curve in all_curves:
        if (curve.depth, curve.image, curve.batch, curve.strategy) == (depth, 500, 8, strategy):
            return curve
    raise KeyError((depth, strategy))
