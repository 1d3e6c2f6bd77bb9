"""``edgetrain plan --frontier``: every Pareto plan of a model, as a table, JSON or a plot."""

from __future__ import annotations

import importlib.util

from edgetrain.cli.options import input_words
from edgetrain.cli.output import console, emit_json, save_figure, table
from edgetrain.core.chain import Chain
from edgetrain.errors import InvalidInput
from edgetrain.runtime.frontier import FrontierPoint, frontier, knee
from edgetrain.units import format_bytes


def require_matplotlib(command: str) -> None:
    """Fail before any work when matplotlib (the ``plot`` extra) is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidInput(
            f"{command} needs matplotlib; install it with: pip install 'edgetrain[plot]'"
        )


def print_frontier(
    chain: Chain,
    strategy: str,
    fixed_bytes: int,
    shape: tuple[int, ...],
    out: str | None,
    as_json: bool,
) -> None:
    """The frontier of ``strategy`` on ``chain`` with gradients kept between steps (the fixed
    part holds them, as ``edgetrain plan --memory`` plans), the knee marked; plotted to ``out``."""
    points = frontier(chain, strategy=strategy, grads_exist=True, fixed_bytes=fixed_bytes)
    chosen = knee(points)
    if out is not None:
        plot_frontier(points, chosen, f"{chain.name}, {input_words(shape)} ({strategy})", out)
    if as_json:
        emit_json(
            {
                "model": chain.name,
                "strategy": strategy,
                "fixed_bytes": fixed_bytes,
                "points": [
                    {
                        "budget_bytes": p.budget_bytes,
                        "activation_bytes": p.activation_bytes,
                        "recompute_factor": p.recompute_factor,
                        "predicted_seconds": p.seconds,
                        "knee": p == chosen,
                    }
                    for p in points
                ],
            }
        )
        return
    console.print(
        table(
            f"{strategy} frontier for {chain.name}, {input_words(shape)}: "
            f"{len(points)} plans (fixed part {format_bytes(fixed_bytes)})",
            ["budget", "activations", "recompute factor", "predicted s", ""],
            [
                [
                    format_bytes(p.budget_bytes),
                    format_bytes(p.activation_bytes),
                    f"{p.recompute_factor:.3f}",
                    f"{p.seconds:.3g}",
                    "knee" if p == chosen else ("smallest" if p is points[0] else ""),
                ]
                for p in points
            ],
        )
    )
    console.print(
        f"smallest budget {format_bytes(points[0].budget_bytes)} "
        f"(recompute factor {points[0].recompute_factor:.3f}); knee "
        f"{format_bytes(chosen.budget_bytes)} ({chosen.recompute_factor:.3f}); storing "
        f"everything {format_bytes(points[-1].budget_bytes)}"
        + (f"; plotted to {out}" if out else "")
    )


def plot_frontier(points: list[FrontierPoint], chosen: FrontierPoint, title: str, out: str) -> None:
    """Budget against recompute factor, the knee marked; written atomically to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.step(
        [p.recompute_factor for p in points],
        [p.budget_bytes / 2**20 for p in points],
        where="post",
        marker=".",
        label="Pareto plans",
    )
    ax.plot([chosen.recompute_factor], [chosen.budget_bytes / 2**20], "o", color="C3", label="knee")
    ax.set_xlabel("recompute factor ρ (time over plain autograd's)")
    ax.set_ylabel("memory budget (MiB)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out)
