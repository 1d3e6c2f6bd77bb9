"""``edgetrain tiles``: runs local workers, reports per rank, checks, and rejects bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from torch import nn

from edgetrain.cli.main import cli
from edgetrain.errors import InvalidInput
from edgetrain.models import build
from edgetrain.tiles.layers import describe
from edgetrain.tiles.supported import TILE_MODELS


def _run(*args: str):
    """``edgetrain tiles`` with ``args``; a single string is split on spaces."""
    words = args[0].split() if len(args) == 1 else list(args)
    return CliRunner().invoke(cli, ["tiles", *words])


def test_json_reports_every_rank_and_check_agrees_with_one_process_at_an_odd_size():
    # 33x45 px: the poolings drop the last row or column of odd maps (33 -> 16, 45 -> 22 -> 11
    # -> 5 -> 2), as torch does
    result = _run(
        "--grid 1x2 --image 33x45 --groups per-layer --steps 2 --dtype float64 --json --check"
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["groups"] == ",".join(str(i) for i in range(16))
    assert doc["image"] == [33, 45]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    for rank in doc["ranks"]:
        assert rank["peak_bytes"] > 0 and rank["step_seconds"] > 0 and rank["bytes_sent"] > 0
        assert rank["halo_bytes"] == rank["predicted_halo_bytes"]
    assert doc["max_rel_diff"] < 1e-10


def test_table_output_names_the_groups_chosen_automatically():
    result = _run("--grid", "1x2", "--image", "32", "--steps", "1", "--device", "pi3-wifi")
    assert result.exit_code == 0, result.output
    assert "groups " in result.output and "rank" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grid", "2by2"], "cannot read grid '2by2'"),
        (["--grid", "3x3", "--image", "32"], "grid 3x3 has more tiles than the 2x2 output"),
        (["--image", "8"], "image 8x8 is too small: layer 11 (max11, pool 2x2/2) gets 1 rows"),
        (["--image", "16", "--batch", "1"], "use a batch of 2 or a larger image"),
        (["--image", "0"], "image 0x0 is empty"),
        (["--image", "20by30"], "cannot read image size '20by30'"),
        (["--groups", "0-3,5-15"], "must be consecutive ranges"),
        (["--groups", "0-3"], "end the last group at 15"),
        (["--model", "tinylm"], "tiles cannot split tinylm, which has no convolutional"),
        (["--model", "vgg"], "unknown model 'vgg'; tiles trains yolov2-16"),
        (["--model", "resnet18", "--cut", "x"], "cannot read --cut 'x'"),
        (["--model", "resnet18", "--grid", "8x8", "--image", "8"], "use a smaller grid"),
        (["--steps", "0"], "'--steps': 0 is not in the range x>=1"),
        (["--batch", "-1"], "'--batch': -1 is not in the range x>=1"),
        (["--threads", "0"], "'--threads': 0 is not in the range x>=1"),
        (["--device", "mars"], "unknown profile"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(args, message):
    result = _run(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output


def test_help_lists_the_models_tiles_train():
    result = _run("--help")
    assert result.exit_code == 0
    assert f"Model to train: {', '.join(TILE_MODELS)}" in " ".join(result.output.split())


def test_the_models_tiles_train_are_chains_or_graphs_fx_captures():
    """TILE_MODELS is not a wish list: the chains describe as tiles, every other model is
    captured whole by torch.fx with windows to tile, and a ResNet is not a chain."""
    import torch

    from edgetrain.tiles.graph import analyse
    from edgetrain.tiles.supported import CHAIN_MODELS

    for name in CHAIN_MODELS:
        describe(build(name), 3, 64, 64)
    for name in ("resnet18", "resnet18-module", "mobilenetv2", "unet"):
        assert name in TILE_MODELS
        _, infos = analyse(build(name), torch.zeros(2, 3, 64, 64))
        assert any(i.kind == "window" for i in infos)
    with pytest.raises(InvalidInput):
        describe(build("resnet18"), 3, 64, 64)


def test_a_resnet_trains_end_to_end_and_matches_one_process():
    result = _run(
        "--model resnet18 --grid 1x2 --image 40 --batch 2 --steps 2 --dtype float64 "
        "--json --check --cut last"
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["cut"] == doc["operations"] and doc["max_rel_diff"] < 1e-10
    for rank in doc["ranks"]:
        assert rank["halo_bytes"] == rank["predicted_halo_bytes"] > 0


def test_a_model_file_trains(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = nn.Conv2d(3, 4, 3, padding=1)\n"
        "        self.b = nn.Conv2d(4, 4, 3, stride=2, padding=1)\n"
        "        self.fc = nn.Linear(4, 3)\n"
        "    def forward(self, x):\n"
        "        y = torch.relu(self.a(x))\n"
        "        y = self.b(y + x.mean(1, keepdim=True))\n"
        "        return self.fc(y.mean((2, 3)))\n\n"
        "def build():\n    return Net()\n"
    )
    result = _run(
        "--model-file",
        f"{path}:build",
        "--grid",
        "1x2",
        "--image",
        "17",
        "--batch",
        "2",
        "--steps",
        "2",
        "--dtype",
        "float64",
        "--json",
        "--check",
        "--cut",
        "last",
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["max_rel_diff"] < 1e-10


def test_a_layer_tiling_cannot_split_is_named():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 64, 2))
    with pytest.raises(InvalidInput, match=r"layer 1 \(Flatten\) contains Flatten"):
        describe(model, 3, 8, 8)


def test_torchrun_starts_ranks_that_find_each_other_and_report():
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    worker = (
        "-m edgetrain.tiles.worker --model yolov2-16 --grid 1x2 --image 35x32 --steps 2 "
        "--groups per-layer --bind 127.0.0.1 --timeout 60 --threads 1"
    )
    done = subprocess.run(
        [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", "2", *worker.split()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert doc["ranks"][0]["loss"] == doc["ranks"][1]["loss"]
    assert all(r["halo_bytes"] > 0 for r in doc["ranks"])
