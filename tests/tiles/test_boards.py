"""Boards that differ: tiles sized by each board's speed, within each board's memory, exact.

The pure half: a profile's boards and the one-line refusals of a bad one, the cut of a map by
shares, the shares that balance the ranks' compute, and the cost model's time of unequal tiles.
The torch half: unequal tiles (a chain with mixed groups and graph models) train exactly as one
process in float64 with the halo bytes the geometry predicts, and ``edgetrain tiles --device
FILE`` gives the faster board the larger tile and keeps every board inside its memory.
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetrain.cli.main import cli
from edgetrain.devices import load
from edgetrain.devices.boards import boards_from_json
from edgetrain.devices.catalog import CLUSTERS
from edgetrain.errors import InvalidInput
from edgetrain.models.resnet_module import resnet_module
from edgetrain.models.unet import UNet
from edgetrain.tiles.balance import balance, speed_shares
from edgetrain.tiles.check import differences, reference
from edgetrain.tiles.front import halo_bytes_sent
from edgetrain.tiles.graph import analyse, front_ops, place
from edgetrain.tiles.grid import Grid, split
from edgetrain.tiles.grouping import rank_compute_seconds, step_cost
from edgetrain.tiles.launch import run_local
from edgetrain.tiles.layers import describe
from edgetrain.tiles.tiling import plan
from edgetrain.tiles.worker import TileJob
from tests.tiles.heap_beyond import HEAP_BEYOND_BYTES
from tests.tiles.test_exact import zoo

LINKS = {name: c.link for name, c in CLUSTERS.items()}

pytestmark = pytest.mark.xdist_group("boards")  # one worker launches each cached run once


def _profile(*speeds: float, memory: str = "2GB") -> dict:
    return {
        "name": "test boards",
        "link": "pi3-ethernet",
        "boards": [
            {"name": f"b{i}", "macs_per_second": s, "memory": memory} for i, s in enumerate(speeds)
        ],
    }


def test_a_profile_reads_each_boards_speed_and_memory_and_round_trips(tmp_path):
    cluster = boards_from_json(_profile(2e9, 1e9, memory="512MB"), LINKS)
    assert [cluster.macs_per_second(r) for r in (0, 1)] == [2e9, 1e9]
    assert cluster.board(1).memory_bytes == 512 * 10**6
    assert cluster.device.macs_per_second == 1e9  # the slowest
    path = tmp_path / "boards.json"
    path.write_text(json.dumps(cluster.to_json()))
    assert load(str(path)) == cluster


def _without(key: str) -> dict:
    doc = _profile(1e9, 1e9)
    del doc["boards"][1][key]
    return doc


BAD = {
    "no boards": ({"name": "x", "link": "pi3-ethernet"}, "no 'boards'"),
    "no link": ({"boards": _profile(1e9)["boards"]}, "no 'link'"),
    "empty boards": ({"link": "pi3-ethernet", "boards": []}, "non-empty list"),
    "no speed": (_without("macs_per_second"), "board 1 of the profile has no 'macs_per_second'"),
    "no memory": (_without("memory"), "board 1 of the profile has no 'memory'"),
    "negative speed": (_profile(1e9, -2.0), "macs_per_second of board 1"),
    "zero speed": (_profile(0, 1e9), "macs_per_second of board 0"),
    "text speed": (_profile("fast", 1e9), "macs_per_second of board 0"),
    "bad memory": (_profile(1e9, memory="lots"), "memory of board 0"),
    "unknown top key": ({**_profile(1e9), "boardz": []}, "unknown key 'boardz' in the profile"),
    "unknown board key": (
        {"link": "pi3-ethernet", "boards": [{"macs_per_second": 1, "memory": 9, "ram": 1}]},
        "unknown key 'ram' in board 0",
    ),
    "unknown link": ({**_profile(1e9), "link": "5g"}, "unknown link '5g'"),
    "link without bandwidth": (
        {**_profile(1e9), "link": {"latency_seconds": 0.001, "shared_medium": False}},
        "no 'bandwidth_bytes_per_second'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_profile_is_one_line_naming_the_problem(case):
    doc, message = BAD[case]
    with pytest.raises(InvalidInput, match=message) as info:
        boards_from_json(doc, LINKS)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("grid", ["2x2", "1x3"])
def test_the_cli_refuses_a_profile_whose_board_count_is_not_the_grids(tmp_path, grid):
    path = tmp_path / "boards.json"
    path.write_text(json.dumps(_profile(2e9, 1e9)))
    result = CliRunner().invoke(cli, ["tiles", "--grid", grid, "--device", str(path)])
    assert result.exit_code == 2
    assert "lists 2 boards but grid" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_cli_refuses_a_bad_profile_in_one_line(tmp_path):
    path = tmp_path / "boards.json"
    path.write_text(json.dumps(_profile(2e9, -1.0)))
    result = CliRunner().invoke(cli, ["tiles", "--grid", "1x2", "--device", str(path)])
    assert result.exit_code == 2
    assert "macs_per_second of board 1" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 400),
    st.lists(st.floats(0.05, 20.0), min_size=1, max_size=6),
)
def test_shares_cut_every_pixel_once_each_span_within_a_pixel_of_its_share(size, shares):
    if size < len(shares):
        with pytest.raises(InvalidInput):
            split(size, len(shares), shares)
        return
    spans = split(size, len(shares), shares)
    assert spans[0][0] == 0 and spans[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(b > a for a, b in spans)
    total, running = sum(shares), 0.0
    for (_, end), share in zip(spans[:-1], shares, strict=False):
        running += share
        # a boundary moves off its rounded place only to keep every span a pixel long
        assert abs(end - size * running / total) <= 0.5 + len(shares)


def test_a_grid_without_shares_cuts_size_over_parts_the_last_taking_the_rest():
    assert Grid(3, 2).row_spans(25) == split(25, 3) == ((0, 8), (8, 16), (16, 25))


def test_shares_follow_the_speeds_on_a_line_and_balance_a_product_exactly():
    line = speed_shares(Grid(1, 3), [3.0, 1.0, 2.0])
    assert line.col_shares == pytest.approx((0.5, 1 / 6, 1 / 3))
    # speeds a_i * b_j: each rank's h_i * w_j / s_ij is the same
    a, b = [1.0, 3.0], [2.0, 1.0, 1.0]
    grid = speed_shares(Grid(2, 3), [x * y for x in a for y in b])
    times = [
        grid.row_shares[i] * grid.col_shares[j] / (a[i] * b[j]) for i in range(2) for j in range(3)
    ]
    assert max(times) == pytest.approx(min(times), rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.lists(st.floats(0.1, 10.0), min_size=9, max_size=9),
)
def test_speed_shares_never_leave_the_slowest_rank_slower_than_equal_tiles(rows, cols, speeds):
    grid = Grid(rows, cols)
    speeds = speeds[: grid.size]
    shared = speed_shares(grid, speeds)

    def slowest(h, w):
        return max(h[r // cols] * w[r % cols] / speeds[r] for r in range(grid.size))

    equal = slowest([1 / rows] * rows, [1 / cols] * cols)
    assert slowest(shared.row_shares, shared.col_shares) <= equal * (1 + 1e-9)
    assert sum(shared.row_shares) == pytest.approx(1) and sum(shared.col_shares) == pytest.approx(1)


def test_the_cli_refuses_memory_with_a_profile_of_boards_in_one_line(tmp_path):
    path = tmp_path / "boards.json"
    path.write_text(json.dumps(_profile(2e9, 1e9)))
    words = ["tiles", "--grid", "1x2", "--memory", "100MB", "--device", str(path)]
    result = CliRunner().invoke(cli, words)
    assert result.exit_code == 2
    assert "not both" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _zoo_net():
    return describe(zoo(), 3, 64, 64)


SPEEDS = [2e9, 1e9, 1.5e9, 0.5e9]


def test_balanced_tiles_make_the_slowest_rank_faster_than_equal_ones():
    net, grouping = _zoo_net(), ((0, 3), (4, 7))
    cluster = boards_from_json(_profile(*SPEEDS), LINKS)

    def seconds(g):
        return rank_compute_seconds(plan(net, g, grouping), cluster, 2)

    equal = max(seconds(Grid(2, 2)))
    started = max(seconds(speed_shares(Grid(2, 2), SPEEDS)))
    balanced = balance(Grid(2, 2), SPEEDS, seconds, 64)
    assert max(seconds(balanced)) <= started < equal
    # the cost model's step time is that of the slowest rank on its own board
    cost = step_cost(net, balanced, grouping, cluster, batch=2)
    assert cost.compute_seconds == pytest.approx(max(seconds(balanced)), rel=1e-12)
    assert cost.seconds < step_cost(net, Grid(2, 2), grouping, cluster, batch=2).seconds


def _graph_job(model, image: int, batch: int, grid: Grid) -> TileJob:
    _, infos = analyse(model, torch.zeros(batch, 3, image, image))
    return TileJob(
        model,
        (image, image),
        batch,
        grid,
        (),
        steps=2,
        dtype="float64",
        collect=True,
        measure_memory=False,
        cut=len(infos),
    )


def _models(seed: int = 3):
    torch.manual_seed(seed)
    return resnet_module(18, num_classes=10), UNet(classes=2, base=4, depth=3)


UNEQUAL = Grid(1, 2).with_shares([1.0], [2.0, 1.0])


def _unequal_jobs() -> list[TileJob]:
    _, unet = _models()
    torch.manual_seed(7)
    chain = TileJob(
        zoo(), (64, 64), 2, UNEQUAL, ((0, 3), (4, 7)), steps=2, dtype="float64", collect=True,
        measure_memory=False,
    )  # fmt: skip
    return [chain, _graph_job(unet, 40, 1, UNEQUAL)]  # ResNet-18 on unequal tiles: the 3x2 cases


_RUNS: dict[str, tuple[list[TileJob], list]] = {}


def _run(key: str, make) -> tuple[list[TileJob], list]:
    if key not in _RUNS:
        jobs = make()
        _RUNS[key] = (jobs, run_local(jobs, threads=1, timeout=300))
    return _RUNS[key]


def _predicted_halo_bytes(job: TileJob, rank: int) -> int:
    if job.cut is None:
        return job.steps * job.plan().halo_bytes_sent(rank, job.batch, 8)
    model = copy.deepcopy(job.model).double()  # the workers train in float64
    graph, infos = analyse(model, torch.zeros(job.batch, 3, *job.image, dtype=torch.float64))
    return job.steps * halo_bytes_sent(
        front_ops(infos, place(graph, infos, job.grid, job.cut)), rank
    )


@pytest.mark.parametrize("index", range(2))
def test_unequal_tiles_train_exactly_as_one_process_with_the_predicted_halos(index):
    jobs, results = _run("unequal", _unequal_jobs)
    job = jobs[index]
    diff = differences(job, results[index], reference(job))
    assert diff.pop("ranks_agree") == 0.0
    worst = max(diff, key=lambda k: diff[k])
    assert diff[worst] <= 1e-10, (index, worst, diff[worst])
    for result in results[index]:
        assert result.halo_bytes == _predicted_halo_bytes(job, result.rank)
    if job.cut is None:  # the chain's output tile follows the shares: 3 of 4 columns, then 1
        widths = [r.output_region.width for r in results[index]]
        assert widths == [3, 1]


# 3x2 grids, graph models, float64 against one process: image sizes the poolings divide (64 px
# for ResNet-18: 32, 16, 8, 4, 2; 48 px for the U-Net: 24, 12, 6) and sizes they floor (70 px:
# 35, 18, 9, 5, 3) on tiles sized for boards that differ. One step each keeps the suite fast.
GRID_3X2 = Grid(3, 2)
CASES_3X2 = [
    ("resnet18", 64, GRID_3X2),
    ("unet", 48, GRID_3X2),
    ("resnet18", 70, speed_shares(GRID_3X2, [1.0, 2.0, 1.0, 1.0, 2.0, 0.5])),
]


def _jobs_3x2() -> list[TileJob]:
    jobs = []
    for name, image, grid in CASES_3X2:
        resnet, unet = _models()
        job = _graph_job(resnet if name == "resnet18" else unet, image, 1, grid)
        jobs.append(replace(job, steps=1))
    return jobs


@pytest.mark.parametrize("index", range(len(CASES_3X2)))
def test_graph_models_on_3x2_grids_equal_one_process(index):
    jobs, results = _run("3x2", _jobs_3x2)
    job = jobs[index]
    diff = differences(job, results[index], reference(job))
    assert diff.pop("ranks_agree") == 0.0
    worst = max(diff, key=lambda k: diff[k])
    assert diff[worst] <= 1e-10, (CASES_3X2[index][:2], worst, diff[worst])
    for result in results[index]:
        assert result.halo_bytes == _predicted_halo_bytes(job, result.rank)


def test_cli_gives_the_faster_board_the_larger_tile_and_trains_exactly(tmp_path):
    # board 1 is half as fast: its tile is about a third of the width, every board's predicted
    # peak is its measured one, and training equals one process in float64
    path = tmp_path / "boards.json"
    path.write_text(json.dumps(_profile(2e9, 1e9)))
    words = "--grid 1x2 --image 48x64 --steps 2 --dtype float64 --json --check --device"
    result = CliRunner().invoke(cli, ["tiles", *words.split(), str(path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["max_rel_diff"] <= 1e-10
    widths = [r["tile"][3] - r["tile"][2] for r in doc["ranks"]]
    assert widths[0] > widths[1]
    assert doc["shares"]["cols"][0] == pytest.approx(2 / 3, abs=0.1)
    for board, rank in zip(doc["boards"], doc["ranks"], strict=True):
        assert board["board_peak_bytes"] == board["predicted_board_peak_bytes"]
        assert board["predicted_board_heap_bytes"] <= board["memory_bytes"]
        heap = board["board_heap_peak_bytes"] or 0  # beyond tensors and scratch: not predicted
        assert heap <= board["predicted_board_heap_bytes"] + HEAP_BEYOND_BYTES
        assert rank["halo_bytes"] == rank["predicted_halo_bytes"]
    times = [b["predicted_compute_seconds"] for b in doc["boards"]]
    assert max(times) / min(times) < 1.25  # balanced within what whole pixels allow


def _fit(*boards: tuple[float, int]):
    from edgetrain.cli.tiles import _chain_setup
    from edgetrain.cli.tiles_boards import fit_profile

    torch.manual_seed(7)
    doc = _profile(*(s for s, _ in boards))
    for board, (_, memory) in zip(doc["boards"], boards, strict=True):
        board["memory"] = memory
    cluster = boards_from_json(doc, LINKS)
    return fit_profile(zoo(), (64, 64), Grid(1, 2), 2, "auto", "auto", cluster, "float64",
                       _chain_setup, True)  # fmt: skip


def test_a_board_short_of_memory_gets_a_smaller_tile_that_fits():
    _, roomy, fitted = _fit((2e9, 2**31), (1e9, 2**31))
    fast = fitted.ranks[0]
    tight = (fast.peak_bytes + fitted.ranks[1].peak_bytes) // 2  # below its balanced need
    _, doc, fitted = _fit((2e9, tight), (1e9, 2**31))
    assert doc["shares"]["cols"][0] < roomy["shares"]["cols"][0]
    assert fitted.ranks[0].peak_bytes <= tight


def test_a_board_that_cannot_hold_the_weights_is_refused_in_one_line():
    with pytest.raises(InvalidInput, match=r"board 1 .* weights and buffers alone") as info:
        _fit((2e9, 2**31), (1e9, 1000))
    assert "\n" not in str(info.value)


def test_torchrun_workers_reading_one_profile_agree_on_its_shares(tmp_path):
    path = tmp_path / "boards.json"
    path.write_text(json.dumps(_profile(2e9, 1e9)))
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    worker = (
        "-m edgetrain.tiles.worker --model yolov2-16 --grid 1x2 --image 32x48 --steps 1 "
        f"--groups per-layer --bind 127.0.0.1 --timeout 60 --threads 1 --profile {path}"
    )
    done = subprocess.run(
        [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", "2", *worker.split()],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    assert doc["grid"].startswith("1x2 (rows 1.00, cols 0.6")
    assert doc["ranks"][0]["loss"] == doc["ranks"][1]["loss"]


def test_the_documented_example_profile_reads():
    cluster = load(str(Path(__file__).resolve().parents[2] / "docs" / "boards-example.json"))
    assert len(cluster.boards) == 2
    assert cluster.macs_per_second(0) == 2 * cluster.macs_per_second(1)
