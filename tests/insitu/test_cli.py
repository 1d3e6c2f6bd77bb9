"""``edgetrain insitu run`` / ``eval`` end to end on a tiny synthetic scene, and bad input.

The end-to-end run is a child process, as a user starts it (training lowers its process's
priority); a refusal before any training runs the same command line in this process."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from edgetrain.cli.main import cli
from edgetrain.insitu.student import CHECKPOINT

# One xdist worker runs the whole file: its module fixtures (a teacher trained into a fresh
# cache, a first run of the scene) would otherwise run once per worker.
pytestmark = pytest.mark.xdist_group("insitu-cli")

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--synthetic", "--frames", "250", "--classes", "3", "--epochs", "1", "--max-batch", "8",
    "--threads", "1", "--idle-threshold", "1", "--teacher-views", "150", "--minutes", "5",
]  # fmt: skip


def edgetrain(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EDGETRAIN_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", "from edgetrain.cli.main import main; main()", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@dataclass(frozen=True)
class Refusal:
    """What a command run in this process ended with."""

    returncode: int
    stdout: str
    stderr: str


def edgetrain_here(args: list[str], cache: Path) -> Refusal:
    """``edgetrain ARGS`` through the same click entry point, in this process; torch's thread
    count (which the command sets) is put back after it."""
    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(
            cli, args, env={"EDGETRAIN_CACHE_DIR": str(cache)}, prog_name="edgetrain"
        )
    finally:
        torch.set_num_threads(threads)
    unexpected = "" if isinstance(result.exception, SystemExit | None) else repr(result.exception)
    return Refusal(result.exit_code, result.stdout, result.stderr + unexpected)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> tuple[Path, dict]:
    store = tmp_path_factory.mktemp("run") / "store"
    first = edgetrain(["insitu", "run", *SMALL, "--store", str(store), "--json"], cache)
    assert first.returncode == 0, first.stderr[-3000:]
    return store, json.loads(first.stdout)


def test_run_reports_then_a_rerun_resumes_without_storing_anything_twice(
    first_run: tuple[Path, dict], cache: Path
) -> None:
    store, report = first_run
    for key in ("teacher_accuracy", "student_accuracy", "label_precision", "label_recall"):
        assert 0.0 <= report[key] <= 1.0
    assert report["images"] > 0 and 0 < report["mean_image_bytes"] <= 10_000
    assert report["by_angle"] and set(report["by_angle"][0]) == {
        "from_deg", "to_deg", "n", "teacher", "student",
    }  # fmt: skip
    assert report["video_finished"] and report["training_finished"]
    assert report["measured_peak_bytes"] <= report["memory_bytes"]
    assert (store / "insitu.png").read_bytes()[:4] == b"\x89PNG"
    again = edgetrain(["insitu", "run", *SMALL, "--store", str(store), "--json"], cache)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads(again.stdout)
    assert resumed["images"] == report["images"]
    assert resumed["tracked_crops"] == report["tracked_crops"]
    assert resumed["student_steps"] == report["student_steps"] == report["student_total_steps"]
    evaluated = edgetrain(["insitu", "eval", "--store", str(store), "--json"], cache)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout)["student_accuracy"] == report["student_accuracy"]


PROGRESS = re.compile(r"^\d\d:\d\d:\d\d edgetrain: ")  # a note of work taking over 2 s


def _one_line_error(result: Refusal, text: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [x for x in result.stderr.strip().splitlines() if not PROGRESS.match(x)]
    assert len(lines) == 1 and lines[0].startswith("edgetrain: error:") and text in lines[0]


def test_bad_input_ends_in_one_line_and_exit_2(tmp_path: Path, cache: Path) -> None:
    bad = tmp_path / "clip.avi"
    bad.write_bytes(b"garbage")
    store = tmp_path / "s"
    _one_line_error(
        edgetrain_here(["insitu", "run", "--video", str(bad), "--store", str(store)], cache),
        "cannot read video",
    )
    assert not store.exists()  # nothing was created before the check
    _one_line_error(edgetrain_here(["insitu", "eval", "--store", str(tmp_path)], cache), "not an")
    _one_line_error(
        edgetrain_here(
            ["insitu", "run", *SMALL, "--memory", "100KB", "--store", str(store)], cache
        ),
        "give more --memory",
    )


def test_a_corrupt_checkpoint_is_one_line_and_the_store_survives(
    first_run: tuple[Path, dict], tmp_path: Path, cache: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(first_run[0], store)
    images = sorted(p.name for p in (store / "images").iterdir())
    (store / CHECKPOINT).write_bytes(b"edgetrain-state sha256=00 bytes=3\nabc")
    _one_line_error(
        edgetrain_here(["insitu", "run", *SMALL, "--store", str(store)], cache), "checksum"
    )
    assert sorted(p.name for p in (store / "images").iterdir()) == images


def _set_meta(store: Path, key: str, value: str) -> None:
    db = sqlite3.connect(store / "store.sqlite")
    with db:
        db.execute("UPDATE meta SET value = ? WHERE key = ?", (value, key))
    db.close()


@pytest.mark.parametrize(
    ("command", "key", "value", "text"),
    [
        ("run", "source", "{not json", "source record is unreadable"),
        ("run", "frame_next", "abc", "not a whole number"),
        ("eval", "source", "{not json", "source record is unreadable"),
    ],
)
def test_a_damaged_meta_value_is_one_line_and_the_store_survives(
    first_run: tuple[Path, dict], tmp_path: Path, cache: Path, command, key, value, text
) -> None:
    """A damaged meta value is one line from ``insitu run``, not a JSONDecodeError or int()
    traceback."""
    store = tmp_path / "store"
    shutil.copytree(first_run[0], store)
    images = sorted(p.name for p in (store / "images").iterdir())
    _set_meta(store, key, value)
    args = [*SMALL] if command == "run" else []
    _one_line_error(edgetrain_here(["insitu", command, *args, "--store", str(store)], cache), text)
    assert sorted(p.name for p in (store / "images").iterdir()) == images


@pytest.mark.parametrize("command", ["run", "eval"])
def test_another_state_file_as_the_checkpoint_is_one_line(
    first_run: tuple[Path, dict], tmp_path: Path, cache: Path, command
) -> None:
    """The teacher's cached state copied over the student's checkpoint: its checksum holds, and
    reading it is one line, not a KeyError traceback."""
    store = tmp_path / "store"
    shutil.copytree(first_run[0], store)
    teacher = next(cache.glob("teacher-*.pt"))
    shutil.copy(teacher, store / CHECKPOINT)
    args = [*SMALL] if command == "run" else []
    _one_line_error(
        edgetrain_here(["insitu", command, *args, "--store", str(store)], cache),
        "another kind of state file",
    )


def test_an_unwritable_teacher_cache_is_one_line_before_the_teacher_is_trained(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = edgetrain_here(
        ["insitu", "run", *SMALL, "--store", str(tmp_path / "s")], blocker / "c"
    )
    _one_line_error(result, "cannot write the teacher's cache")
