"""The boards that remain when one drops out are planned as a start is: their grid, tile shares and
each rank's recomputation chosen for their budgets or their speeds, every survivor's peak
predicted again and measured equal to it; survivors no grid fits stop in one line, exit 2."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner

from edgetrain.cli.main import cli
from edgetrain.cli.tiles import _chain_setup
from edgetrain.cli.tiles_boards import fit_profile
from edgetrain.devices import load
from edgetrain.errors import InvalidInput
from edgetrain.tiles.grid import Grid
from edgetrain.tiles.recovery import Decision
from tests.tiles.heap_beyond import HEAP_BEYOND_BYTES
from tests.tiles.test_exact import zoo

pytestmark = pytest.mark.xdist_group("tiles")

MODEL = """\
from torch import nn


def _block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


def build():
    return nn.Sequential(_block(3, 16), _block(16, 16), nn.MaxPool2d(2), _block(16, 8))
"""

# The model above at 64 px, batch 2, float64 (predicted, weights and kernel scratch included):
# a 1x2 grid's ranks store everything in 9.3 MB; one board alone needs 17.2 MB storing
# everything and at least 16.0 MB recomputing all it can.
ROOMY_BYTES = 16_600_000  # two boards store everything; one alone recomputes
TIGHT_BYTES = 12_000_000  # two boards fit; one alone cannot


def _tiles(tmp_path, *words: str):
    path = tmp_path / "tiny.py"
    path.write_text(MODEL)
    head = f"tiles --model-file {path}:build --image 64 --batch 2 --dtype float64 --timeout 30"
    return CliRunner().invoke(cli, [*head.split(), *words])


def test_the_survivor_of_a_budget_is_planned_again_and_measures_its_prediction(tmp_path):
    words = f"--grid 1x2 --steps 3 --memory {ROOMY_BYTES} --fault die:1:1 --check --json"
    result = _tiles(tmp_path, *words.split())
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["recoveries"] == [
        "board 1 was killed by SIGKILL during step 1; 1 continue on a 1x1 grid and repeat step 1"
    ]
    assert doc["max_rel_diff"] <= 1e-10  # the weights of a run that lost no board
    assert doc["start"]["grid"] == "1x2"
    assert doc["grid"] == "1x1"
    (survivor,) = doc["ranks"]
    # the larger tile is predicted again: more than either start rank, recomputing to fit
    assert survivor["predicted_board_heap_bytes"] > max(doc["start"]["predicted_board_heap_bytes"])
    assert doc["memory"]["recompute"] != [[]]
    assert doc["memory"]["chosen"].startswith("grid 1x1")
    assert survivor["board_peak_bytes"] == survivor["predicted_board_peak_bytes"]
    assert survivor["predicted_board_heap_bytes"] <= ROOMY_BYTES
    assert survivor["board_peak_bytes"] <= ROOMY_BYTES
    heap = survivor["board_heap_peak_bytes"] or 0  # beyond tensors and scratch: not predicted
    assert heap <= survivor["predicted_board_heap_bytes"] + HEAP_BEYOND_BYTES


def test_survivors_no_grid_fits_stop_in_one_line_naming_what_they_need(tmp_path):
    words = f"--grid 1x2 --steps 3 --memory {TIGHT_BYTES} --fault die:1:1 --json"
    result = _tiles(tmp_path, *words.split())
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "edgetrain: error: board 1 was killed by SIGKILL during step 1; board 0 remains and "
        "cannot continue: no grid of 1 boards trains in 11.44 MiB per board"
    )
    least = re.search(r"give --memory (\d+) or more", lines[0])
    assert least is not None and int(least.group(1)) > TIGHT_BYTES


def _profile(tmp_path, *speeds: float, memory: tuple[int | str, ...] = ()) -> str:
    memory = memory or ("2GB",) * len(speeds)
    boards = [
        {"name": f"b{i}", "macs_per_second": s, "memory": m}
        for i, (s, m) in enumerate(zip(speeds, memory, strict=True))
    ]
    path = tmp_path / "boards.json"
    path.write_text(json.dumps({"name": "three", "link": "pi3-ethernet", "boards": boards}))
    return str(path)


def test_survivors_of_boards_that_differ_take_tiles_in_proportion_to_their_speeds(tmp_path):
    profile = _profile(tmp_path, 1e9, 1e9, 3e9)
    words = f"--grid 1x3 --steps 2 --device {profile} --fault die:0:1 --check --json"
    result = _tiles(tmp_path, *words.split())
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (line,) = doc["recoveries"]
    assert line.startswith("board 0 was killed by SIGKILL during step 1; 2 continue on a 1x2")
    assert doc["max_rel_diff"] <= 1e-10
    assert [(b["rank"], b["profile_board"], b["board"]) for b in doc["boards"]] == [
        (0, 1, "b1"),
        (1, 2, "b2"),
    ]
    assert doc["shares"]["cols"] == pytest.approx([0.25, 0.75], abs=0.05)  # speeds 1 : 3
    widths = [r["tile"][3] - r["tile"][2] for r in doc["ranks"]]
    assert widths[1] >= 2 * widths[0]
    for rank in doc["ranks"]:  # step 1 again, on the survivors' tiles
        assert rank["halo_bytes"] == rank["predicted_halo_bytes"] > 0
    for board in doc["boards"]:
        assert board["board_peak_bytes"] == board["predicted_board_peak_bytes"]
        assert board["predicted_board_heap_bytes"] <= board["memory_bytes"]


def test_a_decision_carries_the_survivors_layout_through_its_file():
    grid = Grid(1, 2).with_shares([1.0], [1.0, 3.0])
    decision = Decision(
        3, (2, 0), grid, 5, ((0, 1), (2, 4)), None, (frozenset({0, 3}), frozenset())
    )
    assert Decision.from_json(decision.to_json()) == decision
    graph = Decision(1, (1,), Grid(1, 1), 0, (), 17, ())
    assert Decision.from_json(graph.to_json()) == graph


def test_the_boards_that_remain_of_a_profile_keep_their_speeds_and_memory(tmp_path):
    cluster = load(_profile(tmp_path, 1e9, 2e9, 3e9))
    rest = cluster.of_boards((2, 0))
    assert [b.name for b in rest.boards] == ["b2", "b0"]
    assert rest.device == cluster.boards[0]  # the slowest of them
    assert rest.link == cluster.link
    alike = load("pi3-ethernet")
    assert alike.of_boards((0, 1)) is alike


def test_a_remaining_board_that_cannot_fit_is_named_by_its_place_in_the_profile(tmp_path):
    torch.manual_seed(0)
    cluster = load(_profile(tmp_path, 1e9, 1e9, 3e9, memory=("2GB", "2GB", 1000)))
    rest = cluster.of_boards((0, 2))
    with pytest.raises(InvalidInput, match=r"^board 2 \(b2\) has 1000 B but the model's weights"):
        fit_profile(zoo(), (64, 64), Grid(1, 2), 2, "auto", "auto", rest, "float64",
                    _chain_setup, True, None, (0, 2))  # fmt: skip
