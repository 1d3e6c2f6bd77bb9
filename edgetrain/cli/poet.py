"""``edgetrain poet`` and ``edgetrain poet-figure``: least-energy recomputation and paging plans.

The training graph comes from a model (shapes only, costs for a device profile) or from a graph
file (edgetrain's JSON or a POET instance, which carries its own costs). The MILP runs on HiGHS;
the answer states whether it is optimal, feasible with a gap, proven infeasible or not found.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from edgetrain import progress
from edgetrain.cli.options import BATCH, IMAGE, OutputFile
from edgetrain.cli.output import console, emit_json, save_figure, table
from edgetrain.errors import InfeasibleBudget, InvalidInput
from edgetrain.planners.poet.check import ACCOUNTINGS
from edgetrain.planners.poet.graph import TrainingGraph
from edgetrain.planners.poet.milp import MODES, MilpResult
from edgetrain.units import format_bytes, parse_bytes


def _graph_options(command: Any) -> Any:
    for option in reversed(
        [
            click.option("--model", "model_name", default="resnet18", show_default=True),
            click.option("--batch", default=2, show_default=True, type=BATCH),
            click.option("--image", default=32, show_default=True, type=IMAGE),
            click.option(
                "--graph",
                "graph_path",
                default=None,
                help="A graph JSON (edgetrain-graph-v1 or poet-instance-v1) instead of a model.",
            ),
            click.option(
                "--device",
                default=None,
                help="Energy profile: m0, m4f, rpi4, tx2, odroid-xu4, this, or a .json [rpi4].",
            ),
            click.option(
                "--page-dir",
                default=None,
                help="Directory to measure for --device this (the 'SD card').",
            ),
            click.option(
                "--watts", type=float, default=None, help="Power under load for --device this."
            ),
            click.option(
                "--runtime",
                type=float,
                default=None,
                help="Runtime budget: this many times one pass over every node, e.g. 1.5.",
            ),
            click.option(
                "--accounting",
                type=click.Choice(ACCOUNTINGS),
                default="edgetrain",
                show_default=True,
            ),
            click.option(
                "--time-limit", type=float, default=60.0, show_default=True, help="Seconds."
            ),
        ]
    ):
        command = option(command)
    return command


def load_graph(
    model_name: str,
    batch: int,
    image: int,
    graph_path: str | None,
    device: str | None,
    page_dir: str | None,
    watts: float | None,
) -> TrainingGraph:
    """The graph to plan: from a file, or from a model on a device profile."""
    from edgetrain.devices import energy
    from edgetrain.planners.poet import graph as graphs

    if graph_path is not None:
        if device is not None:
            raise InvalidInput("drop --device: a graph file carries its own costs")
        return graphs.load(graph_path)
    if batch < 1 or image < 1:
        raise InvalidInput("--batch and --image must be at least 1")
    name = device or "rpi4"
    if name == "this":
        if page_dir is None or watts is None:
            raise InvalidInput(
                "--device this measures the machine: give --page-dir DIR and --watts W"
            )
        profile = energy.measure_this(page_dir, compute_watts=watts)
    else:
        profile = energy.get(name)
    from edgetrain.models import canonical_name, check_image

    check_image(canonical_name(model_name), image, batch)
    from edgetrain.frontend.profiling import NOMINAL_FLOPS
    from edgetrain.models import model_chain

    chain = model_chain(model_name, batch, image)
    return graphs.from_chain(chain, profile, chain_flops_per_second=NOMINAL_FLOPS)


def read_ram(text: str | None) -> tuple[float, bool] | None:
    """``--memory`` read without the graph: (bytes, False) for "2MB", (percent, True) for "50%";
    InvalidInput for anything else, before the graph is built."""
    if text is None:
        return None
    stripped = text.strip()
    if stripped.endswith("%"):
        try:
            percent = float(stripped[:-1])
        except ValueError as exc:
            raise InvalidInput(f"cannot read --memory {text!r}; write e.g. 50% or 2MB") from exc
        if not 0 < percent < float("inf"):
            raise InvalidInput(f"--memory {text!r} must be positive")
        return percent, True
    return float(parse_bytes(stripped)), False


def ram_budget(text: str | None, graph: TrainingGraph, accounting: str) -> float | None:
    """``--memory``: bytes ("2MB") or a percentage of the keep-everything peak ("50%")."""
    from edgetrain.planners.poet import check as poet_check

    read = read_ram(text)
    if read is None:
        return None
    value, percent = read
    if percent:
        everything = poet_check.evaluate(graph, poet_check.store_all(graph), accounting)  # type: ignore[arg-type]
        return everything.peak_ram_bytes * value / 100
    return value


class _Progress:
    """One status line on stderr while HiGHS works: elapsed, best energy, lower bound."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.shown = False

    def __call__(self, elapsed: float, best: float | None, bound: float | None) -> None:
        if not self.enabled:
            return
        best_text = "-" if best is None else f"{best:.6g} J"
        bound_text = "-" if bound is None else f"{bound:.6g} J"
        line = f"solving: {elapsed:5.1f} s, best {best_text}, lower bound {bound_text}"
        click.echo(("\r" if self.tty else "") + line, err=True, nl=not self.tty)
        self.shown = True

    def done(self) -> None:
        if self.shown and self.tty:
            click.echo("", err=True)


def result_json(result: MilpResult, graph: TrainingGraph) -> dict[str, Any]:
    """The documented JSON object of one solve."""
    ev = result.evaluation
    return {
        "status": result.status,
        "energy_J": result.energy_joules,
        "lower_bound_J": result.lower_bound_joules,
        "gap": result.gap,
        "solve_seconds": round(result.solve_seconds, 4),
        "peak_ram_bytes": None if ev is None else ev.peak_ram_bytes,
        "runtime_s": None if ev is None else ev.runtime_seconds,
        "compute_J": None if ev is None else ev.compute_joules,
        "pagein_J": None if ev is None else ev.pagein_joules,
        "pageout_J": None if ev is None else ev.pageout_joules,
        "recomputed": None if ev is None else ev.recomputed,
        "paged_out": None if ev is None else ev.paged_out,
        "paged_in": None if ev is None else ev.paged_in,
        "ram_budget_bytes": result.ram_budget_bytes,
        "runtime_budget_s": result.runtime_budget_seconds,
        "smallest_ram_bytes": result.smallest_ram_bytes,
        "accounting": result.accounting,
        "mode": result.mode,
        "graph": graph.name,
        "device": graph.device,
        "nodes": len(graph),
        "edges": len(graph.edges),
        "variables": result.variables,
        "constraints": result.constraints,
        "message": result.message,
        "matrices": result.matrices(),
    }


@click.command(name="poet")
@_graph_options
@click.option(
    "--memory",
    "ram",
    default=None,
    help="RAM budget: bytes (2MB) or % of keep-everything (50%).",
)
@click.option("--mode", type=click.Choice(MODES), default="hybrid", show_default=True)
@click.option(
    "--export-graph",
    type=OutputFile(".json"),
    default=None,
    help="Also write the graph as edgetrain JSON here.",
)
@click.option("--json", "as_json", is_flag=True)
def poet_command(
    model_name: str,
    batch: int,
    image: int,
    graph_path: str | None,
    device: str | None,
    page_dir: str | None,
    watts: float | None,
    runtime: float | None,
    accounting: str,
    time_limit: float,
    ram: str | None,
    mode: str,
    export_graph: str | None,
    as_json: bool,
) -> None:
    """Least-energy plan of recomputation and paging (POET's MILP on HiGHS)."""
    from edgetrain.core.schedule import atomic_write_text
    from edgetrain.planners.poet import milp

    if not 0 < time_limit < float("inf"):
        raise InvalidInput("--time-limit must be positive seconds, e.g. 60")
    if runtime is not None and not 0 < runtime < float("inf"):
        raise InvalidInput("--runtime must be a positive factor, e.g. 1.5")
    read_ram(ram)  # its format, before the graph is built
    graph = load_graph(model_name, batch, image, graph_path, device, page_dir, watts)
    budget = ram_budget(ram, graph, accounting)
    if export_graph:
        atomic_write_text(Path(export_graph), graph.to_json() + "\n")
    progress = _Progress(enabled=True)
    result = milp.solve(
        graph,
        ram_bytes=budget,
        runtime_factor=runtime,
        mode=mode,  # type: ignore[arg-type]
        accounting=accounting,  # type: ignore[arg-type]
        time_limit=time_limit,
        progress=progress,
    )
    progress.done()
    if as_json:
        emit_json(result_json(result, graph))
    else:
        _print(result, graph)
    if result.status == "infeasible":
        smallest = result.smallest_ram_bytes
        if smallest is not None:
            hint = f"; the smallest RAM that meets this runtime is {smallest:.0f} bytes"
        elif "runtime" in result.message:
            hint = "; raise --runtime"
        else:
            hint = "; raise --memory or --runtime"
        raise InfeasibleBudget(
            f"no plan fits {_budget_text(budget)} within "
            f"{'no runtime limit' if runtime is None else f'{runtime}x the runtime'}{hint}",
            smallest,
        )
    if result.status == "no_solution":
        click.echo(
            f"edgetrain: no plan found within {time_limit:g} s; raise --time-limit", err=True
        )
        sys.exit(1)


def _budget_text(budget: float | None) -> str:
    return "unlimited RAM" if budget is None else f"{budget:.0f} bytes of RAM"


def _print(result: MilpResult, graph: TrainingGraph) -> None:
    ev = result.evaluation

    def joules(value: float | None) -> str:
        return "-" if value is None else f"{value:.6g} J"

    rows: list[list[str]] = [
        ["status", result.status],
        ["energy", joules(result.energy_joules)],
    ]
    if ev is not None:
        rows += [
            ["  compute", joules(ev.compute_joules)],
            ["  page-in", joules(ev.pagein_joules)],
            ["  page-out", joules(ev.pageout_joules)],
            ["runtime", f"{ev.runtime_seconds:.6g} s"],
            ["peak RAM", format_bytes(ev.peak_ram_bytes)],
            [
                "recomputed / paged out / paged in",
                f"{ev.recomputed} / {ev.paged_out} / {ev.paged_in}",
            ],
        ]
    rows += [
        ["lower bound", joules(result.lower_bound_joules)],
        ["gap", "-" if result.gap is None else f"{100 * result.gap:.4f} %"],
        ["solve time", f"{result.solve_seconds:.2f} s"],
        [
            "RAM budget",
            "-" if result.ram_budget_bytes is None else format_bytes(result.ram_budget_bytes),
        ],
        [
            "runtime budget",
            "-"
            if result.runtime_budget_seconds is None
            else f"{result.runtime_budget_seconds:.6g} s",
        ],
    ]
    if result.smallest_ram_bytes is not None:
        rows.append(["smallest feasible RAM", format_bytes(result.smallest_ram_bytes)])
    rows.append(["MILP", f"{result.variables} variables, {result.constraints} constraints"])
    console.print(
        table(
            f"POET plan for {graph.name} on {graph.device or '?'} ({len(graph)} nodes), "
            f"{result.mode}, {result.accounting} accounting",
            ["", "value"],
            rows,
            caption=result.message,
        )
    )


@click.command(name="poet-figure")
@_graph_options
@click.option("--points", default=8, show_default=True, type=int, help="RAM budgets to solve.")
@click.option(
    "--smallest",
    default=0.2,
    show_default=True,
    type=float,
    help="Smallest budget as a fraction of keep-everything.",
)
@click.option(
    "--out",
    type=OutputFile(".png"),
    default="poet.png",
    show_default=True,
    help="PNG file to write.",
)
@click.option("--json", "as_json", is_flag=True)
def poet_figure(
    model_name: str,
    batch: int,
    image: int,
    graph_path: str | None,
    device: str | None,
    page_dir: str | None,
    watts: float | None,
    runtime: float | None,
    accounting: str,
    time_limit: float,
    points: int,
    smallest: float,
    out: str,
    as_json: bool,
) -> None:
    """POET's picture: energy against RAM budget for hybrid, remat-only and paging-only."""
    from edgetrain.planners.poet import check as poet_check

    if points < 2:
        raise InvalidInput("--points must be at least 2")
    if not 0 < smallest < 1:
        raise InvalidInput("--smallest must be a fraction between 0 and 1, e.g. 0.2")
    plt = _pyplot()  # fail before the long work when matplotlib is missing
    target = Path(out)
    if not target.parent.exists():
        raise InvalidInput(f"cannot write {out}: directory {target.parent} does not exist")
    graph = load_graph(model_name, batch, image, graph_path, device, page_dir, watts)
    everything = poet_check.evaluate(graph, poet_check.store_all(graph), accounting)  # type: ignore[arg-type]
    fractions = [smallest + (1 - smallest) * i / (points - 1) for i in range(points)]
    curves: dict[str, list[dict[str, Any]]] = {}
    with progress.task("solving POET's MILP", total=len(MODES) * points) as step:
        for mode in MODES:
            curves[mode] = _curve(
                graph,
                mode,
                fractions,
                everything.peak_ram_bytes,
                step,
                runtime,
                accounting,
                time_limit,
            )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, rows in curves.items():
        xs = [r["ram_bytes"] / 2**20 for r in rows if r["energy_J"] is not None]
        ys = [r["energy_J"] for r in rows if r["energy_J"] is not None]
        ax.plot(
            xs,
            ys,
            marker="o",
            label={"remat": "remat only", "paging": "paging only"}.get(mode, mode),
        )
    ax.axhline(graph.compute_joules, color="black", linewidth=0.8, label="every node once")
    ax.set_xlabel("RAM budget (MiB)")
    ax.set_ylabel("energy per step (J)")
    ax.set_title(f"{graph.name} on {graph.device}: energy vs RAM ({accounting} accounting)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out)
    if as_json:
        emit_json({"out": out, "graph": graph.name, "device": graph.device, "curves": curves})
        return
    rows_out = [
        [
            f"{100 * fractions[i]:.0f} %",
            *(
                "infeasible"
                if curves[m][i]["energy_J"] is None
                else f"{curves[m][i]['energy_J']:.6g}"
                for m in MODES
            ),
        ]
        for i in range(len(fractions))
    ]
    console.print(table("energy (J) by RAM budget", ["RAM", *MODES], rows_out))
    console.print(f"figure written to {out}")


def _curve(
    graph: TrainingGraph,
    mode: str,
    fractions: list[float],
    everything_bytes: float,
    step: progress.Task,
    runtime: float | None,
    accounting: str,
    time_limit: float,
) -> list[dict[str, Any]]:
    """One mode's solves at each fraction of the keep-everything peak, each reported to
    ``step`` (a line each off a terminal, a bar on one)."""
    from edgetrain.planners.poet import milp

    rows = []
    for fraction in fractions:
        budget = everything_bytes * fraction
        result = milp.solve(
            graph,
            ram_bytes=budget,
            runtime_factor=runtime,
            mode=mode,  # type: ignore[arg-type]
            accounting=accounting,  # type: ignore[arg-type]
            time_limit=time_limit,
            find_smallest_ram=False,
        )
        rows.append(
            {
                "fraction": fraction,
                "ram_bytes": budget,
                "status": result.status,
                "energy_J": result.energy_joules,
                "gap": result.gap,
            }
        )
        step(detail=f"{mode} at {100 * fraction:.0f} %: {result.status}")
    return rows


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InvalidInput(
            "poet-figure needs matplotlib; install it with: pip install 'edgetrain[plot]'"
        ) from exc
    return plt
