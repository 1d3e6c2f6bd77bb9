"""``insitu run``: --frames and --minutes are bounded, and the time limit holds from the start
even for the longest synthetic video."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgetrain.cli.insitu import MAX_MINUTES
from edgetrain.cli.main import cli
from edgetrain.errors import InvalidInput
from edgetrain.insitu.scene import MAX_FRAMES, SyntheticScene

ROOT = Path(__file__).resolve().parents[2]


def _insitu_run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "EDGETRAIN_CACHE_DIR": str(tmp_path / "cache"),
        "EDGETRAIN_PROGRESS": "0",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-c", "from edgetrain.cli.main import main; main()"]
    return subprocess.run(
        [*command, "insitu", "run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--frames", str(10**20), f"1<=x<={MAX_FRAMES}"),
        ("--frames", str(MAX_FRAMES + 1), f"1<=x<={MAX_FRAMES}"),
        ("--minutes", "1e9", f"0<x<={MAX_MINUTES}"),
    ],
)
def test_frames_and_minutes_past_their_bound_are_one_line(tmp_path, flag, value, message):
    """Refused while the command line is read (in this process, through the same entry point)."""
    result = CliRunner().invoke(
        cli,
        ["insitu", "run", "--store", str(tmp_path / "s"), flag, value],
        env={"EDGETRAIN_CACHE_DIR": str(tmp_path / "cache"), "EDGETRAIN_PROGRESS": "0"},
        prog_name="edgetrain",
    )
    assert result.exit_code == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and message in lines[0], result.stderr
    assert not (tmp_path / "s").exists()


def test_the_longest_video_starts_and_stops_at_the_time_limit(tmp_path):
    args = ["--frames", str(MAX_FRAMES), "--minutes", "0.05", "--classes", "2"]
    args += ["--teacher-views", "20", "--epochs", "1", "--threads", "1"]
    result = _insitu_run([*args, "--store", str(tmp_path / "s"), "--json"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert not report["video_finished"] and report["frames"] < MAX_FRAMES
    assert any("time ran out" in note for note in report["notes"])


def test_a_scene_longer_than_the_bound_is_refused():
    with pytest.raises(InvalidInput, match="at most 1,000,000 frames"):
        SyntheticScene(0, frames=MAX_FRAMES + 1)


def test_a_frame_draws_exactly_the_objects_in_view():
    scene = SyntheticScene(5, frames=4000, classes=6)
    for index in range(0, 4000, 7):
        window = {t.object_id for t in scene.frame(index).truth}
        every = {
            obj.object_id
            for obj in scene.objects
            if scene._position(obj, index) is not None  # the whole list, no window
        }
        assert window <= every
        drawn = [o for o in scene.objects if o.object_id in every]
        assert all(index - o.start <= scene._longest_frames for o in drawn)
