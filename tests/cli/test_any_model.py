"""`edgetrain plan` and `train` on models with a forward() (registered ones and a user's own
--model-file), and the one-line exit-2 answer to every mistake in naming or loading a model."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from edgetrain.cli.main import cli
from edgetrain.models import MODEL_NAMES

PROGRESS_LINE = re.compile(r"^\d\d:\d\d:\d\d edgetrain: ")

USER_MODEL = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.norm(self.conv(x)))  # a residual


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stem.requires_grad_(False)  # a frozen layer
        self.blocks = nn.Sequential(Block(8), Block(8), Block(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.blocks(torch.tanh(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return -self.a(x)


def build():
    return Net()


def build_with_input():
    torch.manual_seed(1)
    return Net(), torch.randn(3, 3, 12, 12)


def boom():
    raise RuntimeError("out of coffee")


def quits():
    import sys
    sys.exit(0)


def not_a_model():
    return 42


def branchy():
    return Branchy()


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return y, y.sum()


def pair():
    return Pair(), torch.randn(2, 4)
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(USER_MODEL)
    return path


def run_json(*args: str) -> dict:
    result = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def error_line(*args: str) -> str:
    """The one line a mistake prints (progress lines aside); fails unless the exit status is 2."""
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    lines = [line for line in lines if not PROGRESS_LINE.match(line)]
    assert len(lines) == 1, result.output
    return lines[0]


def smallest_and_plain(*setting: str) -> tuple[int, int]:
    """The least device memory any plan needs (quoted by the budget error) and plain autograd's."""
    plan = run_json("plan", *setting)
    line = error_line("plan", *setting, "--memory", str(plan["fixed_bytes"] + 1))
    return int(re.search(r"\((\d+) bytes\)", line).group(1)), plan["peak_bytes"]


def test_plan_of_a_captured_resnet_shows_its_cuts_and_runs_as_saved(tmp_path):
    path = tmp_path / "plan.json"
    setting = ("--model", "resnet18-module", "--batch", "2", "--image", "32")
    smallest, plain = smallest_and_plain(*setting)
    budget = str((smallest + plain) // 2)  # the plan must recompute
    plan = run_json("plan", *setting, "--memory", budget, "--save", str(path))
    names = [s["name"] for s in plan["stages"]]
    # stages are named for the operations they run; cuts inside a block carry trunk and skip
    assert names[0] == "conv1" and names[-1] == "fc"
    assert any(n.startswith("layer3.1.") for n in names)
    assert {s["tensors"] for s in plan["stages"]} == {1, 2}
    assert plan["peak_bytes"] <= int(budget) and plan["recomputed_stages"] > 0
    assert plan["input_shape"] == [2, 3, 32, 32] and plan["predicted_seconds"] > 0
    # a saved plan is refused unless it was made for this model's stages: train runs it
    report = run_json("train", *setting, "--steps", "2", "--plan", str(path))
    assert report["stages"] == len(names) and report["recompute_factor"] > 1
    # a plan that recomputes is not the module itself: one graph, or the executor's stages
    assert report["runs_as"] == "one graph" or report["runs_as"].endswith(" stages")
    # the plan's bytes (from shapes) are the measured chain's; train predicts the plan as it
    # runs (runs of stages merged into one graph, sized as they run): within the plan's budget
    # and 1 % of the plan's own peak
    predicted = report["predicted_peak_bytes"]
    assert predicted <= int(budget)
    assert predicted == pytest.approx(plan["peak_bytes"], rel=0.01)
    assert report["measured_peak_bytes"] == pytest.approx(report["predicted_peak_bytes"], rel=0.05)


@pytest.mark.parametrize(
    ("model", "image", "loss"),
    [("unet", "16", "mean squared error")],
)
def test_train_a_registered_module_model_measures_what_the_plan_predicts(model, image, loss):
    report = run_json(
        "train",
        "--model",
        model,
        "--batch",
        "2",
        "--image",
        image,
        "--steps",
        "2",
        "--recompute",
        "1.5",
    )
    assert report["model"] == model and report["loss"] == loss
    assert report["stages"] > 1 and report["recompute_factor"] <= 1.5
    assert report["predicted_peak_bytes"] <= report["plain_peak_bytes"]
    assert report["measured_peak_bytes"] == pytest.approx(report["predicted_peak_bytes"], rel=0.05)


def test_plan_takes_every_registered_model():
    # plans come from shapes on meta tensors: every model, at its smallest input, in seconds
    from edgetrain.models import MODELS

    for name in ("vit-tiny", "tinylm", "yolov2-16"):
        info = MODELS[name]
        size = info.min_size if info.input == "image" else 8
        plan = run_json("plan", "--model", name, "--batch", "2", "--image", str(size))
        assert plan["model"] == name and plan["stages_total"] == len(plan["stages"]) > 1


def test_plan_and_train_a_users_model_file(user_file):
    setting = ("--model-file", f"{user_file}:build", "--input-shape", "2,3,16,16")
    plan = run_json("plan", *setting, "--recompute", "1.5")
    assert plan["model"] == "my_model.py:build" and plan["input_shape"] == [2, 3, 16, 16]
    names = [s["name"] for s in plan["stages"]]
    assert names[0] == "stem" and "tanh" in names and names[-1] == "head"
    assert any(s["tensors"] == 2 for s in plan["stages"])  # inside a residual block
    assert plan["recompute_factor"] <= 1.5 and plan["recomputed_stages"] > 0
    smallest, plain = smallest_and_plain(*setting)
    budget = (smallest + plain) // 2
    report = run_json("train", *setting, "--steps", "3", "--memory", str(budget))
    assert report["input_shape"] == [2, 3, 16, 16] and report["stages"] == len(names)
    assert report["recompute_factor"] > 1 and report["predicted_peak_bytes"] <= budget
    assert report["measured_peak_bytes"] == pytest.approx(report["predicted_peak_bytes"], rel=0.05)
    assert report["loss"] == "cross-entropy"


def test_a_factory_that_returns_its_example_input_sets_the_shape(user_file):
    spec = f"{user_file}:build_with_input"
    plan = run_json("plan", "--model-file", spec)
    assert plan["input_shape"] == [3, 3, 12, 12] and plan["batch"] == 3
    report = run_json("train", "--model-file", spec, "--steps", "2")
    assert report["input_shape"] == [3, 3, 12, 12]
    assert report["measured_peak_bytes"] == pytest.approx(report["predicted_peak_bytes"], rel=0.05)


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model-file", "{dir}/missing.py:build"], "does not exist"),
        (["--model-file", "{dir}/my_model.py"], "is not FILE.py:FUNCTION"),
        (["--model-file", "{dir}/notes.txt:build"], "is not a .py file"),
        (["--model-file", "{dir}/my_model.py:make"], "has no function 'make'"),
        (["--model-file", "{dir}/my_model.py:boom"], "raised RuntimeError: out of coffee"),
        (["--model-file", "{dir}/my_model.py:not_a_model"], "returned int, not an nn.Module"),
        (["--model-file", "{dir}/my_model.py:branchy"], "cannot capture Branchy: a Python if"),
        (["--model-file", "{dir}/broken.py:build"], "failed: SyntaxError"),
        (["--model-file", "{dir}/script.py:build"], "called sys.exit(2); put the script's own"),
        (["--model-file", "{dir}/my_model.py:quits"], "quits called sys.exit(0); the factory"),
        (
            ["--model-file", "{dir}/my_model.py:build_with_input", "--input-shape", "2,3,8,8"],
            "returns its own example input",
        ),
        (
            ["--model-file", "{dir}/my_model.py:build", "--input-shape", "2,3,8,8", "--batch", "2"],
            "give --input-shape or --batch, not both",
        ),
        (["--model-file", "{dir}/my_model.py:build", "--input-shape", "2,x"], "not a whole number"),
        (["--model", "unet", "--model-file", "{dir}/my_model.py:build"], "not both"),
        (["--model", "unet", "--input-shape", "2,3,16,16"], "--input-shape is for --model-file"),
        (["--model", "resnet19"], "unknown model 'resnet19'; choose one of"),
        (["--model", "unet", "--image", "24"], "use a multiple of 16"),
        (
            ["--model-file", "{dir}/my_model.py:boom", "--memory", "1GB", "--recompute", "2"],
            "give --memory or --recompute, not both",
        ),
        (
            ["--model-file", "{dir}/my_model.py:build_with_input", "--batch", "4"],
            "returns its own example input",
        ),
    ],
)
def test_mistakes_with_models_exit_2_with_one_line(tmp_path, command, args, message):
    (tmp_path / "my_model.py").write_text(USER_MODEL)
    (tmp_path / "notes.txt").write_text(USER_MODEL)
    (tmp_path / "broken.py").write_text("def build(:\n")
    # A training script whose top level exits (as its argument parsing does on a bad flag).
    (tmp_path / "script.py").write_text(USER_MODEL + "\nimport sys\nsys.exit(2)\n")
    line = error_line(command, *(a.format(dir=tmp_path) for a in args))
    assert message in line
    if "unknown model" in message:
        assert all(name in line for name in MODEL_NAMES)


def test_train_refuses_a_model_that_returns_no_single_tensor_in_one_line(user_file):
    line = error_line("train", "--model-file", f"{user_file}:pair", "--steps", "1")
    assert "returns one floating-point tensor, got tuple" in line


@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_model_file_runs_only_after_every_flag_is_checked(tmp_path, command):
    marker = tmp_path / "ran"
    source = tmp_path / "side_effect.py"
    source.write_text(
        f"open({str(marker)!r}, 'w').close()\nimport torch\ndef build():\n"
        "    return torch.nn.Linear(2, 2)\n"
    )
    line = error_line(command, "--model-file", f"{source}:build", "--memory", "2XB")
    assert "cannot read size" in line and not marker.exists()
    # and it does run when the command line is right (what --help warns about)
    CliRunner().invoke(cli, [command, "--model-file", f"{source}:build", "--input-shape", "2,2"])
    assert marker.exists()


@pytest.mark.parametrize("command", ["plan", "train"])
def test_help_says_what_a_factory_returns_and_that_it_runs_user_code(command):
    text = " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split())
    assert "FILE.py:FUNCTION" in text and "(model, example_input)" in text
    assert "runs your code" in text
