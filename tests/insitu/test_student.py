"""The student trainer: the planner's batch, resumable training that ends bit-identical after
kill -9, and clear errors for an empty store and a corrupt checkpoint."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from edgetrain.errors import CorruptFile, InfeasibleBudget
from edgetrain.insitu.files import load_state
from edgetrain.insitu.network import INPUT, classifier
from edgetrain.insitu.store import Store, StoreError
from edgetrain.insitu.student import CHECKPOINT, TrainConfig, plan_at, plan_batch, train_student
from tests.insitu.helpers import CLASSES, TEST_CONFIG, fill, teacher_state

ROOT = Path(__file__).resolve().parents[2]


def test_the_batch_is_the_largest_whose_planned_step_fits_the_budget() -> None:
    model = classifier(CLASSES)
    budget = plan_at(model, 37, TrainConfig()).predicted_peak_bytes + 1
    config = TrainConfig(memory_bytes=budget, max_batch=10_000)
    chosen = plan_batch(model, config, find_largest=True)
    assert chosen.batch == 37 == chosen.largest_fitting
    assert chosen.predicted_peak_bytes <= budget
    assert plan_at(model, 38, config).predicted_peak_bytes > budget
    assert chosen.recompute_factor <= config.recompute + 1e-9


def test_the_batch_is_capped_and_a_budget_below_batch_one_is_refused() -> None:
    model = classifier(CLASSES)
    assert plan_batch(model, TrainConfig(max_batch=8)).batch == 8
    with pytest.raises(InfeasibleBudget, match="give more --memory"):
        plan_batch(model, TrainConfig(memory_bytes=100_000))


def _train(directory: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.insitu.helpers", "train", str(directory)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )


def test_training_killed_9_and_resumed_ends_with_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    fill(tmp_path / "base", 6, per_track=8)  # 48 images, batch 8: 6 steps an epoch, 24 in all
    shutil.copytree(tmp_path / "base", tmp_path / "whole")
    shutil.copytree(tmp_path / "base", tmp_path / "killed")
    whole = _train(tmp_path / "whole")
    assert whole.wait(timeout=300) == 0
    checkpoint = tmp_path / "killed" / CHECKPOINT
    rng = random.Random(11)
    kills = 0
    for _ in range(2):
        child = _train(tmp_path / "killed")
        start = load_state(checkpoint)["step"] if checkpoint.exists() else 0
        deadline = time.monotonic() + 120
        while (
            time.monotonic() < deadline
            and child.poll() is None
            and (not checkpoint.exists() or load_state_step(checkpoint) == start)
        ):
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            kills += 1
        child.wait()
        saved = load_state(checkpoint)  # every checkpoint left behind verifies
        assert saved["step"] >= start
    resumed = _train(tmp_path / "killed")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and out.startswith(b"done 24")
    assert kills >= 1
    a = load_state(tmp_path / "whole" / CHECKPOINT)
    b = load_state(checkpoint)
    assert a["step"] == b["step"] == 24
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for key, value in a["optimizer"]["state"].items():
        assert torch.equal(
            value["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"]
        )


def load_state_step(path: Path) -> int:
    try:
        return int(load_state(path)["step"])
    except (CorruptFile, OSError):
        return -1


def test_a_corrupt_checkpoint_is_refused_and_the_store_is_kept(tmp_path: Path) -> None:
    fill(tmp_path, 2, per_track=8)
    store, _ = Store.open(tmp_path)
    with store:
        train_student(store, CLASSES, teacher_state(), TEST_CONFIG)
        data = bytearray((tmp_path / CHECKPOINT).read_bytes())
        data[-10] ^= 0xFF
        (tmp_path / CHECKPOINT).write_bytes(bytes(data))
        with pytest.raises(CorruptFile, match="checksum"):
            train_student(store, CLASSES, teacher_state(), TEST_CONFIG)
        assert store.count() == 16


def test_an_empty_store_is_refused(tmp_path: Path) -> None:
    store, _ = Store.open(tmp_path)
    with store, pytest.raises(StoreError, match="no labelled images"):
        train_student(store, CLASSES, teacher_state(), TEST_CONFIG)


def test_corrupt_images_are_skipped_and_reported_not_trained_on(tmp_path: Path) -> None:
    fill(tmp_path, 2, per_track=8)
    store, _ = Store.open(tmp_path)
    with store:
        rows, _ = store.rows()
        (store.images_dir / rows[0].file).write_bytes(b"broken")
        result = train_student(store, CLASSES, teacher_state(), TEST_CONFIG)
        assert result.skipped_images == 1 and result.images == 15
        assert result.finished


def test_measured_step_memory_is_within_the_budget(tmp_path: Path) -> None:
    fill(tmp_path, 2, per_track=8)
    store, _ = Store.open(tmp_path)
    with store:
        result = train_student(store, CLASSES, teacher_state(), TEST_CONFIG)
    assert 0 < result.measured_peak_bytes <= TEST_CONFIG.memory_bytes
    assert result.predicted_peak_bytes <= TEST_CONFIG.memory_bytes
    assert result.batch == 8 and INPUT == 64
