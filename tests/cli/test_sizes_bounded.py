"""Batch, image side and input sizes are bounded on every command that takes them: a size past
the bound (2^63 included, which overflows inside torch) is one line and exit 2 before any work."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from edgetrain.cli.main import cli
from edgetrain.cli.options import MAX_BATCH, MAX_IMAGE
from edgetrain.cli.train import machine_memory_bytes

HUGE = str(2**63)

BATCH_COMMANDS = [
    ["plan"],
    ["train", "--steps", "1"],
    ["demo"],
    ["tiles"],
    ["memory"],
    ["poet"],
    ["poet-figure"],
]
IMAGE_COMMANDS = [["plan"], ["train", "--steps", "1"], ["memory"], ["poet"], ["poet-figure"]]


def _one_line(args: list[str]) -> str:
    result = CliRunner().invoke(cli, args, env={"EDGETRAIN_PROGRESS": "0"})
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize("command", BATCH_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("value", [HUGE, str(MAX_BATCH + 1)])
def test_a_batch_past_the_bound_is_one_line(command, value):
    line = _one_line([*command, "--batch", value])
    assert "--batch" in line and f"at most {MAX_BATCH}" in line


@pytest.mark.parametrize("command", IMAGE_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("value", [HUGE, str(MAX_IMAGE + 1)])
def test_an_image_side_past_the_bound_is_one_line(command, value):
    line = _one_line([*command, "--image", value])
    assert "--image" in line and f"at most {MAX_IMAGE}" in line


@pytest.mark.parametrize("image", [HUGE, f"{MAX_IMAGE + 1}x32", f"32x{MAX_IMAGE + 1}"])
def test_a_tile_image_past_the_bound_is_one_line(image):
    line = _one_line(["tiles", "--image", image])
    assert f"give at most {MAX_IMAGE}" in line


def test_insitu_max_batch_is_bounded(tmp_path):
    line = _one_line(["insitu", "run", "--store", str(tmp_path / "s"), "--max-batch", HUGE])
    assert "--max-batch" in line and f"at most {MAX_BATCH}" in line
    assert not (tmp_path / "s").exists()


def test_an_input_shape_of_too_many_values_is_one_line():
    line = _one_line(["plan", "--model-file", __file__ + ":f", "--input-shape", f"{HUGE},3"])
    assert "--input-shape" in line and "more than the" in line


def test_the_largest_batch_and_image_still_plan():
    result = CliRunner().invoke(
        cli,
        ["plan", "--batch", str(MAX_BATCH), "--image", str(MAX_IMAGE), "--json"],
        env={"EDGETRAIN_PROGRESS": "0"},
    )
    assert result.exit_code == 0, result.output


def test_train_refuses_an_input_larger_than_the_machine_before_building_it():
    batch = MAX_BATCH
    assert batch * 3 * 224**2 * 4 > machine_memory_bytes()
    line = _one_line(["train", "--batch", str(batch), "--steps", "1"])
    assert "the input alone (batch 1048576, 224x224) needs" in line
    assert "more than this machine's" in line and "lower --batch or --image" in line
