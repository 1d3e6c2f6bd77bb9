"""The POET MILP on HiGHS: POET's published optima, monotonicity, the chain DP, the checker."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgetrain.core.chain import Chain
from edgetrain.core.simulator import simulate
from edgetrain.errors import InfeasibleBudget
from edgetrain.planners import plan
from edgetrain.planners.optimal import TableMaker, fastest
from edgetrain.planners.optimal import store_all as dp_store_all
from edgetrain.planners.poet import check, formulation, highs, milp, warmstart
from edgetrain.planners.poet import graph as G
from edgetrain.planners.poet.model import plan_from, start_from
from tests.conftest import UNIT, output_saving_chain

DATA = Path(__file__).parents[2] / "data" / "poet_linear_m0.json"

# POET's published solutions of poet_linear_m0.json (runtime multiplier 2.0).
POET_TABLE = [
    (None, "optimal", 0.10467864),
    (5000, "optimal", 0.10467864),
    (4000, "optimal", 0.10472616),
    (3500, "optimal", 0.1048577428),
    (3000, "infeasible", None),
]


@pytest.fixture(scope="module")
def linear() -> G.TrainingGraph:
    return G.load(DATA)


@pytest.mark.parametrize(("ram", "status", "energy"), POET_TABLE)
def test_poet_accounting_reproduces_every_row_of_the_published_table(
    linear: G.TrainingGraph, ram: int | None, status: str, energy: float | None
) -> None:
    result = milp.solve(linear, ram_bytes=ram, runtime_factor=2.0, accounting="poet")
    assert result.status == status
    if energy is None:
        assert result.energy_joules is None and result.plan is None
        # The smallest budget that works lies between the infeasible one and the next row's.
        assert result.smallest_ram_bytes is not None and 3000 < result.smallest_ram_bytes <= 3500
        proof = milp.solve(
            linear, ram_bytes=result.smallest_ram_bytes, runtime_factor=2.0, accounting="poet"
        )
        assert proof.status == "optimal"
        return
    assert result.energy_joules == pytest.approx(energy, rel=1e-9)
    assert result.gap is not None and result.gap <= 1e-7
    assert result.plan is not None
    assert check.violations(linear, result.plan) == []
    cost = check.evaluate(linear, result.plan, "poet")
    assert ram is None or cost.peak_ram_bytes <= ram
    assert cost.runtime_seconds <= 2.0 * linear.compute_seconds * (1 + 1e-12)


def test_the_3500_byte_optimum_pages(linear: G.TrainingGraph) -> None:
    result = milp.solve(linear, ram_bytes=3500, runtime_factor=2.0, accounting="poet")
    assert result.evaluation is not None and result.evaluation.paged_out >= 1
    remat = milp.solve(linear, ram_bytes=3500, runtime_factor=2.0, accounting="poet", mode="remat")
    assert remat.status == "infeasible" or remat.energy_joules > result.energy_joules  # type: ignore[operator]


@pytest.mark.parametrize("accounting", ["poet", "edgetrain"])
@pytest.mark.parametrize("mode", ["hybrid", "remat", "paging"])
def test_energy_never_rises_as_the_budget_grows(
    linear: G.TrainingGraph, accounting: str, mode: str
) -> None:
    previous = None
    for ram in range(3000, 7600, 400):
        result = milp.solve(
            linear,
            ram_bytes=ram,
            runtime_factor=2.0,
            accounting=accounting,
            mode=mode,  # type: ignore[arg-type]
        )
        assert result.status in ("optimal", "infeasible")
        if result.status == "infeasible":
            assert previous is None, f"{ram} B infeasible after a smaller budget was feasible"
            continue
        assert result.plan is not None
        assert check.violations(linear, result.plan, accounting) == []  # type: ignore[arg-type]
        assert result.evaluation is not None and result.evaluation.peak_ram_bytes <= ram
        if previous is not None:
            assert result.energy_joules <= previous * (1 + 1e-7)  # type: ignore[operator]
        previous = result.energy_joules


def test_edgetrain_accounting_counts_paging_time(linear: G.TrainingGraph) -> None:
    result = milp.solve(linear, ram_bytes=3500, runtime_factor=2.0, accounting="edgetrain")
    assert result.plan is not None and result.evaluation is not None
    poet_view = check.evaluate(linear, result.plan, "poet")
    paging = result.evaluation.runtime_seconds - poet_view.runtime_seconds
    expected = sum(
        n.pagein_seconds * int(result.plan["page_in"][:, i].sum())
        + n.pageout_seconds * int(result.plan["page_out"][:, i].sum())
        for i, n in enumerate(linear.nodes)
    )
    assert paging == pytest.approx(expected)
    assert result.evaluation.runtime_seconds <= 2.0 * linear.compute_seconds * (1 + 1e-12)


def test_a_runtime_budget_below_one_pass_is_infeasible(linear: G.TrainingGraph) -> None:
    result = milp.solve(linear, ram_bytes=5000, runtime_factor=0.9)
    assert result.status == "infeasible" and result.plan is None


def test_a_time_limit_never_reports_optimal_without_proof(linear: G.TrainingGraph) -> None:
    result = milp.solve(
        linear, ram_bytes=3500, runtime_factor=2.0, accounting="poet", time_limit=0.01
    )
    assert result.status in ("feasible", "no_solution", "optimal")
    if result.status == "feasible":
        assert result.gap is not None and result.lower_bound_joules is not None
        assert result.lower_bound_joules <= result.energy_joules  # type: ignore[operator]
    if result.status == "optimal":
        assert result.energy_joules == pytest.approx(0.1048577428, rel=1e-9)


def test_the_checker_rejects_broken_plans(linear: G.TrainingGraph) -> None:
    good = milp.solve(linear, ram_bytes=3500, runtime_factor=2.0, accounting="poet").plan
    assert good is not None
    broken = {k: v.copy() for k, v in good.items()}
    broken["R"][5, 5] = 0
    assert any("does not compute" in v for v in check.violations(linear, broken))
    broken = {k: v.copy() for k, v in good.items()}
    _, i = np.argwhere(good["page_in"])[0]
    broken["S_flash"][:, i] = 0
    broken["page_out"][:, i] = 0
    assert check.violations(linear, broken)
    broken = {k: v.copy() for k, v in good.items()}
    broken["S_ram"][:] = 0
    assert any("without its input" in v for v in check.violations(linear, broken))


def _dp_seconds(chain: Chain, budget: int, *, release: bool = True) -> float | None:
    # One slot per byte: the DP rounds sizes up to whole slots, which at its default resolution
    # can hide a plan whose peak is exactly the budget. Integer sizes make this table exact.
    # ``release=False``: rotor's DP alone (no Fr, which POET's memory model has no term for).
    try:
        if not release:
            maker = TableMaker(chain, release=False)
            return simulate(chain, fastest(maker, budget, slots=budget)).seconds
        return simulate(chain, plan(chain, "optimal", memory=budget, slots=budget)).seconds
    except InfeasibleBudget:
        return None


@pytest.mark.parametrize("seed", range(4))
def test_milp_without_paging_matches_the_optimal_chain_dp(seed: int) -> None:
    """On chains where the two memory models coincide, the MILP is never slower than the DP,
    both find the same budgets feasible, and they agree at most budgets.

    They coincide on chains whose stages keep only their output for backward (``saves_output``,
    no saved tensors, input not saved): a forward's output is then both the checkpoint and the
    graph, as in the MILP's one-output nodes, and simulate's memory (transient peaks = outputs)
    is the MILP's ``edgetrain`` accounting (keep-everything peaks are asserted equal). The MILP may
    be faster:
    the DP keeps every checkpoint until its sub-chain is done (persistent plans), the MILP may drop
    one at the peak and recompute it later. At least half of the feasible budgets must agree,
    and wherever they differ the MILP's time is lower, never higher.
    """
    rng = random.Random(seed)
    chain = output_saving_chain(rng, 5, saves_input=False)
    graph = G.from_chain(chain, UNIT, chain_flops_per_second=1.0)
    peak = simulate(chain, dp_store_all(chain)).peak_bytes
    assert check.evaluate(graph, check.store_all(graph), "edgetrain").peak_ram_bytes == peak
    equal = feasible = 0
    for budget in range(4, peak + 5, 4):
        dp = _dp_seconds(chain, budget)
        result = milp.solve(graph, ram_bytes=budget, mode="remat", accounting="edgetrain")
        if dp is None:
            assert result.status == "infeasible", budget
            continue
        feasible += 1
        assert result.status == "optimal", budget
        assert result.energy_joules is not None
        assert result.energy_joules <= dp * (1 + 1e-9), budget
        equal += result.energy_joules == pytest.approx(dp, rel=1e-9)
    assert feasible >= 3 and 2 * equal >= feasible


@pytest.mark.parametrize("seed", range(3))
def test_milp_brackets_the_chain_dp_when_stages_save_their_input(seed: int) -> None:
    """With saved inputs (and outputs), one-output nodes cannot tell a checkpoint from a graph.

    Ignoring what a graph retains (``retains`` dropped) makes the MILP optimistic, honouring it
    for every forward makes it pessimistic; the DP's optimum lies in between.
    """
    rng = random.Random(100 + seed)
    chain = output_saving_chain(rng, 5, saves_input=True)
    graph = G.from_chain(chain, UNIT, chain_flops_per_second=1.0)
    relaxed = replace(graph, retains=())
    peak = simulate(chain, dp_store_all(chain)).peak_bytes
    for budget in range(4, peak + 1, 4):
        dp = _dp_seconds(chain, budget, release=False)
        low = milp.solve(relaxed, ram_bytes=budget, mode="remat")
        high = milp.solve(graph, ram_bytes=budget, mode="remat")
        if dp is None:
            assert high.status == "infeasible"
            continue
        assert low.status == "optimal"
        assert low.energy_joules <= dp * (1 + 1e-9)  # type: ignore[operator]
        if high.status == "optimal":
            assert dp <= high.energy_joules * (1 + 1e-9)  # type: ignore[operator]


def test_matrices_list_the_ids_set_per_stage(linear: G.TrainingGraph) -> None:
    result = milp.solve(linear, ram_bytes=3500, runtime_factor=2.0, accounting="poet")
    listed = result.matrices()
    assert listed is not None and set(listed) == {"R", "S_ram", "S_flash", "page_in", "page_out"}
    assert result.plan is not None
    for key, rows in listed.items():
        rebuilt = np.zeros((len(linear), len(linear)), dtype=np.int64)
        for t, ids in enumerate(rows):
            rebuilt[t, ids] = 1
        assert (rebuilt == result.plan[key]).all()
    json.dumps(listed)


# Paging a few bytes costs about as much as recomputing a stage: optima mix both.
PAGING = replace(
    UNIT,
    name="paging",
    pagein_bytes_per_second=8.0,
    pageout_bytes_per_second=8.0,
    pagein_latency_seconds=0.25,
    pageout_latency_seconds=0.25,
)


def _optimum(
    graph: G.TrainingGraph, ram: float, accounting: str, **build: object
) -> tuple[str, float | None]:
    """Solve one formulation of the MILP to optimality: (status, energy of its plan in J)."""
    model, variables, scale, _ = formulation.build(
        graph, ram, 2.0 * graph.compute_seconds, "hybrid", accounting, **build
    )
    status, highspy, values, _objective, _dual, _seconds = highs.run(
        model, 60.0, 1e-9, 1, None, scale
    )
    if status == highspy.HighsModelStatus.kInfeasible:
        return "infeasible", None
    assert status == highspy.HighsModelStatus.kOptimal and values is not None
    plan = plan_from(values, variables)
    assert check.violations(graph, plan, accounting) == []  # type: ignore[arg-type]
    cost = check.evaluate(graph, plan, accounting)  # type: ignore[arg-type]
    assert cost.peak_ram_bytes <= ram * (1 + 1e-9)
    return "optimal", cost.energy_joules


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("accounting", ["poet", "edgetrain"])
def test_valid_inequalities_and_one_sided_free_keep_the_optimum(seed: int, accounting: str) -> None:
    """The strengthened model (flash keeps what is paged out, once; a value back in RAM was kept,
    recomputed or is on flash; ``Free`` bounded from above only) has the optimum of the plain one
    at every budget, on chains where the optima page and recompute."""
    rng = random.Random(200 + seed)
    graph = G.from_chain(
        output_saving_chain(rng, 5, saves_input=False), PAGING, chain_flops_per_second=1.0
    )
    peak = check.evaluate(graph, check.store_all(graph), accounting).peak_ram_bytes  # type: ignore[arg-type]
    paged = 0
    for fraction in (0.9, 0.75, 0.6, 0.45):
        ram = fraction * peak
        plain = _optimum(graph, ram, accounting, strengthen=False, pin_free=True)
        strong = _optimum(graph, ram, accounting)
        assert strong[0] == plain[0], fraction
        if plain[1] is not None:
            assert strong[1] == pytest.approx(plain[1], rel=1e-7), fraction
            paged += plain[1] > graph.compute_joules * (1 + 1e-9)
    assert paged >= 1


@pytest.mark.parametrize("ram", [4000, 3500, 3300])
def test_strengthened_model_reproduces_the_linear_optima(
    linear: G.TrainingGraph, ram: float
) -> None:
    plain = _optimum(linear, ram, "poet", strengthen=False, pin_free=True)
    strong = _optimum(linear, ram, "poet")
    assert strong[0] == plain[0] == "optimal"
    assert strong[1] == pytest.approx(plain[1], rel=1e-9)


def test_the_restricted_search_returns_a_valid_plan_no_better_than_the_optimum(
    linear: G.TrainingGraph,
) -> None:
    allowed = warmstart.neighbourhood(linear)
    t_count = len(linear)
    assert allowed["R"].diagonal().all() and not np.triu(allowed["R"], 1).any()
    assert allowed["R"].sum() < t_count * (t_count + 1) / 2  # it restricts something
    plan, energy = warmstart.restricted(
        linear, 3500, 2.0 * linear.compute_seconds, "hybrid", "poet", 30.0, 1, None, 0.0
    )
    assert plan is not None
    assert check.violations(linear, plan, "poet") == []
    assert check.evaluate(linear, plan, "poet").peak_ram_bytes <= 3500
    assert energy >= 0.1048577428 * (1 - 1e-9)


def test_a_start_that_pages_out_twice_enters_the_model_paging_out_once(
    linear: G.TrainingGraph,
) -> None:
    """The strengthened model pages a node out at most once and keeps it on flash; a start plan
    that pages out twice (valid for POET, one page-out wasted) is normalised, not rejected."""
    plan = check.store_all(linear)
    i = 1
    held = np.flatnonzero(plan["S_ram"][:, i])
    assert len(held) >= 2
    plan["page_out"][held[0], i] = plan["page_out"][held[1], i] = 1
    plan["S_flash"][held[0] + 1 :, i] = 1
    assert check.violations(linear, plan, "poet") == []
    _model, variables, _scale, _ = formulation.build(
        linear, None, 2.0 * linear.compute_seconds, "hybrid", "poet"
    )
    cols, values = start_from(plan, variables)
    chosen = dict(zip(cols.tolist(), values.tolist(), strict=True))
    outs = [chosen.get(int(c), 0.0) for c in variables.page_out[:, i] if c >= 0]
    assert sum(outs) == 1
    flash = [chosen.get(int(c), 0.0) for c in variables.s_flash[held[0] + 1 :, i] if c >= 0]
    assert flash and all(v == 1 for v in flash)


def test_a_given_plan_starts_the_solver_and_a_broken_one_is_ignored(
    linear: G.TrainingGraph,
) -> None:
    best = milp.solve(linear, ram_bytes=3500, runtime_factor=2.0, accounting="poet")
    assert best.plan is not None and best.energy_joules is not None
    again = milp.solve(
        linear, ram_bytes=3500, runtime_factor=2.0, accounting="poet", initial_plan=best.plan
    )
    assert again.status == "optimal"
    assert again.energy_joules == pytest.approx(best.energy_joules, rel=1e-9)
    assert "given plan" in again.message or "restricted search" in again.message
    broken = {k: v.copy() for k, v in best.plan.items()}
    broken["S_ram"][:] = 0
    ignored = milp.solve(
        linear,
        ram_bytes=3500,
        runtime_factor=2.0,
        accounting="poet",
        initial_plan=broken,
        warm_start=False,
    )
    assert ignored.status == "optimal" and "given plan" not in ignored.message
    assert ignored.energy_joules == pytest.approx(best.energy_joules, rel=1e-9)
    # A plan over the RAM budget is no start either.
    everything = check.store_all(linear)
    over = milp.solve(
        linear,
        ram_bytes=3500,
        runtime_factor=2.0,
        accounting="poet",
        initial_plan=everything,
        warm_start=False,
    )
    assert "given plan" not in over.message
