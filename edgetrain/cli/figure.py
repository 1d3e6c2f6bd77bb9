"""``edgetrain figure1``: reproduce the paper's Figure 1 and check its 2 GB claim."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict

import click

from edgetrain.cli.options import FiniteRange, OutputFile
from edgetrain.cli.output import console, emit_json, save_figure, table
from edgetrain.errors import InvalidInput
from edgetrain.paper.figure1 import CLAIM_RHO, DEPTHS, DEVICE_BYTES, SETTINGS, Curve, claim, curves
from edgetrain.units import format_bytes

FORMATS = (".png", ".pdf", ".svg")
"""The figure formats ``--out`` may name (matplotlib writes each by its suffix)."""


@click.command(name="figure1")
@click.option(
    "--out",
    type=OutputFile(*FORMATS),
    default="fig1.png",
    show_default=True,
    help=f"Figure to write ({', '.join(FORMATS)}); its directory must exist.",
)
@click.option(
    "--max-rho",
    type=FiniteRange(min=1, min_open=True),
    default=3.0,
    show_default=True,
    help="Right end of the x axis (above 1).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the curves and the claim as JSON.")
def figure1(out: str, max_rho: float, as_json: bool) -> None:
    """Peak memory vs recompute factor for LinearResNet-18..152 (paper Figure 1).

    Models: the paper's LinearResNet-18, 34, 50, 101 and 152 (fixed, not selectable).
    Sizes in GiB (2^30 bytes); the paper's "2 GB" device is 2 GiB.
    """
    _require_matplotlib()
    all_curves = curves()
    rows, verdict = claim(all_curves)
    _plot(all_curves, out, max_rho)
    if as_json:
        emit_json(
            {
                "out": out,
                "device_bytes": DEVICE_BYTES,
                "claim_rho": CLAIM_RHO,
                "claim_holds": verdict,
                "claim_rows": [asdict(r) for r in rows],
                "point_fields": ["recompute_factor", "total_bytes"],
                "curves": [asdict(c) for c in all_curves],
            }
        )
        return

    def gib(v: int | None) -> str:
        return "-" if v is None else format_bytes(v)

    console.print(
        table(
            f"Least memory at recompute factor <= {CLAIM_RHO}, 500x500, batch 8 (device: 2 GiB)",
            ["model", "revolve, 4 x weights", "optimal, 4 x weights", "optimal, weights once"],
            [
                [f"LinearResNet-{r.depth}", gib(r.revolve_4w), gib(r.optimal_4w), gib(r.optimal_1w)]
                for r in rows
            ],
        )
    )
    for name, ok in verdict.items():
        console.print(f"claim under {name}: {'holds' if ok else 'does not hold'}")
    console.print(f"figure written to {out}")


def _require_matplotlib() -> None:
    """Fail before the minute of work when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidInput(
            "figure1 needs matplotlib; install it with: pip install 'edgetrain[plot]'"
        )


def _plot(all_curves: list[Curve], out: str, max_rho: float) -> None:
    """Draw the four panels and write them to ``out`` atomically (temp file, then rename)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    colours = dict(zip(DEPTHS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, (image, batch), letter in zip(axes.flat, SETTINGS, "abcd", strict=True):
        for curve in all_curves:
            if (curve.image, curve.batch) != (image, batch):
                continue
            xs = [r for r, _ in curve.points if r <= max_rho]
            ys = [p / 2**30 for r, p in curve.points if r <= max_rho]
            style = "-" if curve.strategy == "optimal" else "--"
            label = f"LinearResNet-{curve.depth} ({curve.strategy})"
            ax.step(xs, ys, style, where="post", color=colours[curve.depth], label=label)
        ax.axhline(
            DEVICE_BYTES / 2**30,
            color="black",
            linewidth=1,
            label="2 GiB device (the paper's 2 GB)",
        )
        ax.set_title(f"({letter}) {image}x{image}, batch {batch}")
        ax.set_yscale("log")
        ax.set_xlim(1, max_rho)
        ax.set_ylabel("peak memory (GiB)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("recompute factor ρ")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("Peak memory vs recompute factor (solid: optimal plan, dashed: Revolve)")
    fig.tight_layout(rect=(0, 0.1, 1, 0.96))
    save_figure(fig, out)
