"""Every bad path or flag a user can type: one line naming it, exit status 2, before any work.

"Before any work" is checked by counting the Python function calls the command makes (not by
timing it, which a shared machine makes noisy): a refusal takes a few thousand, building the
smallest chain or ``figure1``'s 50 s of curves millions.
"""

import os
import re
import sys

import click
import pytest
from click.testing import CliRunner

from edgetrain.cli.main import cli

PROGRESS_LINE = re.compile(r"^\d\d:\d\d:\d\d edgetrain: ")
QUICK = "--model resnet18 --batch 2 --image 64"
# Python calls a refusal may make: click's parsing and the checks (measured: 700-9,000, the
# most when a module is imported first); work makes millions (`plan` of the smallest ResNet-18:
# 1.8 million).
WORK_CALLS = 200_000


def _calls_of(call):
    """``call()``'s result and how many Python function calls it made."""
    count = 0

    def profile(_frame, event, _arg):
        nonlocal count
        count += event == "call"

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = call()
    finally:
        sys.setprofile(before)
    return result, count


def refused(args: list[str]) -> str:
    """Run ``edgetrain args``; assert exit 2, one line and no traceback, before any work;
    return the line."""
    if args and not args[0].startswith("-"):
        # The command's module is imported when the command is first used: importing is not
        # work, so it happens before the count, whichever test ran the command first.
        cli.get_command(click.Context(cli), args[0])
    result, calls = _calls_of(lambda: CliRunner().invoke(cli, args))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert not any(PROGRESS_LINE.match(line) for line in lines), "work started: " + result.output
    assert len(lines) == 1, result.output
    assert lines[0].startswith("edgetrain: error: ")
    assert calls < WORK_CALLS, f"refused only after {calls} Python calls: work ran first"
    return lines[0]


@pytest.fixture
def existing_file(tmp_path):
    path = tmp_path / "good.json"
    path.write_text("{}")
    return path


@pytest.mark.parametrize("command", ["plan " + QUICK + " --save", "figure1 --out"])
def test_an_output_under_a_file_is_refused(command, existing_file):
    target = existing_file / ("p.json" if command.startswith("plan") else "fig.png")
    line = refused([*command.split(), str(target)])
    assert "is a file, not a directory" in line and str(existing_file) in line


@pytest.mark.parametrize("command", ["plan " + QUICK + " --save", "figure1 --out"])
def test_a_missing_directory_is_named_and_not_created(command, tmp_path):
    missing = tmp_path / "no" / "such"
    target = missing / ("p.json" if command.startswith("plan") else "fig.png")
    line = refused([*command.split(), str(target)])
    assert "does not exist" in line and str(missing) in line
    assert not (tmp_path / "no").exists()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize("command", ["plan " + QUICK + " --save", "figure1 --out"])
def test_a_directory_that_takes_no_files_is_refused(command):
    target = "/proc/p.json" if command.startswith("plan") else "/proc/fig.png"
    assert "cannot write in '/proc'" in refused([*command.split(), target])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert "cannot write in" in refused(["plan", "--save", str(locked / "p.json")])
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["figure1", "--out", "fig.txt"], "must end in .png or .pdf or .svg (not .txt)"),
        (["plan", "--save", "plan.yaml"], "must end in .json (not .yaml)"),
        (["plan", "--save", "plan"], "must end in .json; e.g. plan.json"),
    ],
)
def test_an_output_format_the_command_does_not_write_is_refused(args, message):
    assert message in refused(args)


def test_an_output_that_is_a_directory_is_refused(tmp_path):
    folder = tmp_path / "out.png"
    folder.mkdir()
    assert "is a directory" in refused(["figure1", "--out", str(folder)])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--plan", "/no/such/plan.json"], "does not exist"),
        (["train", "--plan", "/"], "is not a file"),
    ],
)
def test_a_plan_to_read_must_be_a_readable_file(args, message):
    assert message in refused(args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--lr", "-1"], "'--lr': -1.0 is not in the range x>0"),
        (["train", "--lr", "0"], "'--lr'"),
        (["train", "--batch", "0"], "'--batch'"),
        (["train", "--image", "-5"], "'--image'"),
        (["train", "--seed", "-1"], "'--seed'"),
        (["train", "--recompute", "0.5"], "'--recompute'"),
        (["train", "--memory", "0"], "must be positive"),
        (["train", "--memory", "-1GB"], "cannot read size"),
        (["train", "--memory", "1GB", "--recompute", "2"], "not both"),
        (["train", "--model", "vgg16"], "unknown model 'vgg16'; choose one of resnet18"),
        (["plan", "--model", "unet", "--image", "20"], "use a multiple of 16"),
        (["train", "--model", "vit-tiny", "--image", "8"], "image 8 is too small for vit-tiny"),
        (["train", "--model-file", "no/such/file.py:build"], "does not exist"),
        (["plan", "--batch", "-1"], "'--batch'"),
        (["plan", "--image", "0"], "'--image'"),
        (["plan", "--memory", "12 parsecs"], "cannot read size"),
        (["plan", "--model", "resnet1"], "unknown model"),
        (["plan", "--strategy", "magic"], "'--strategy'"),
        (["plan", "--recompute", "x"], "'--recompute'"),
        (["plan", "--recompute", "nan"], "'nan' is not a finite number"),
        (["plan", "--recompute", "inf"], "'--recompute'"),
        (["plan", "--memory", "1e999"], "not a finite number of bytes"),
        (["train", "--lr", "nan"], "'--lr'"),
        (["train", "--lr", "inf"], "'--lr'"),
        (["figure1", "--max-rho", "nan"], "'--max-rho'"),
        (["memory", "--batch", "1,-3"], "at least 1"),
        (["memory", "--image", "2x2"], "whole number"),
        (["memory", "--models", " , "], "at least one model"),
        (["memory", "--models", "resnet18,alexnet"], "unknown model 'alexnet'"),
        (["memory", "--memory", "0"], "must be positive"),
        (["memory", "--measure-limit", "lots"], "cannot read size"),
        (["revolve", "--steps", "-2", "--slots", "3"], "'--steps'"),
        (["revolve", "--steps", "10", "--slots", "0"], "'--slots'"),
        (["revolve", "--steps", "10"], "Missing option '--slots'"),
        (["figure1", "--max-rho", "1"], "'--max-rho'"),
        (["demo", "--steps", "0"], "'--steps'"),
        (["demo", "--batch", "-1"], "'--batch'"),
        (["demo", "--memory", "2XB"], "cannot read size"),
        (["plan", "--no-such-flag"], "No such option"),
        (["no-such-command"], "No such command"),
        # each is one line, never a traceback nor silently accepted
        (["insitu", "run", "--seed", "-1", "--store", "s"], "'--seed'"),
        (["insitu", "run", "--classes", "100", "--store", "s"], "'--classes'"),
        (["insitu", "run", "--classes", "0", "--store", "s"], "'--classes'"),
        (["insitu", "run", "--minutes", "nan", "--store", "s"], "'--minutes'"),
        (["insitu", "run", "--idle-threshold", "nan", "--store", "s"], "'--idle-threshold'"),
        (["insitu", "eval", "--store", "s", "--picture", "s/student.ckpt"], "must end in .png"),
        (["insitu", "eval", "--store", "s", "--picture", "/no/such/dir/x.png"], "does not exist"),
        (["poet", "--export-graph", "/no/such/dir/g.json"], "does not exist"),
        (["poet", "--export-graph", "g.ckpt"], "must end in .json"),
        (["poet-figure", "--out", "fig.xyz"], "must end in .png"),
        (["poet-figure", "--out", "/proc/fig.png"], "cannot write in"),
        (["revolve", "--steps", "99999999999999999999", "--slots", "2"], "operations"),
        (["revolve", "--steps", "10000000", "--slots", "1"], "give more slots"),
        (["tiles", "--timeout", "nan"], "'--timeout': 'nan' is not a finite number"),
        (["tiles", "--timeout", "0"], "'--timeout'"),
        (["train", "--model-file", "tests:build"], "is a directory"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(args, message):
    assert message in refused(args)


def test_model_aliases_are_still_accepted(tmp_path):
    result = CliRunner().invoke(
        cli, ["plan", "--model", "ResNet_18", "--batch", "2", "--image", "64", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert '"model": "resnet18"' in result.stdout


@pytest.mark.parametrize("command", ["plan", "train", "memory", "tiles"])
def test_help_lists_the_models_the_command_supports(command):
    from edgetrain.models import MODEL_NAMES, SEQUENTIAL_NAMES

    text = CliRunner().invoke(cli, [command, "--help"]).output
    supported = {
        "plan": MODEL_NAMES,
        "train": MODEL_NAMES,
        "memory": SEQUENTIAL_NAMES,
        "tiles": ["yolov2-16"],
    }[command]
    for name in supported:
        assert name in text, (command, name)


def test_tiles_help_lists_the_device_profiles():
    from edgetrain.devices import CLUSTERS

    text = " ".join(CliRunner().invoke(cli, ["tiles", "--help"]).output.split())
    for name in CLUSTERS:
        assert name in text


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--plan"],
        ["poet", "--graph"],
        ["poet", "--device"],
        ["tiles", "--device"],
    ],
    ids=["train-plan", "poet-graph", "poet-device", "tiles-profile"],
)
def test_a_json_file_that_is_not_text_is_one_line(args, tmp_path):
    """Bytes that are not UTF-8 in a file given as JSON: one line, not a UnicodeDecodeError
    traceback."""
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert "not UTF-8 text" in refused([*args, str(binary)])
