"""An in-situ report without a trained student says so ("-", null), not the teacher's numbers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from edgetrain.cli import insitu as insitu_cli
from edgetrain.insitu.evaluate import Report
from edgetrain.insitu.files import load_state, save_state
from edgetrain.insitu.network import classifier
from edgetrain.insitu.pipeline import evaluate_store
from edgetrain.insitu.store import Store
from edgetrain.insitu.student import CHECKPOINT, CHECKPOINT_KEYS, train_student
from edgetrain.insitu.teacher import Teacher
from tests.insitu.helpers import CLASSES, TEST_CONFIG, fill, teacher_state

META = {"kind": "synthetic", "seed": 3, "frames": 90, "classes": CLASSES, "teacher_views": 1}


def _teacher(tmp_path: Path) -> Teacher:
    model = classifier(CLASSES)
    model.load_state_dict(teacher_state())
    model.eval()
    return Teacher(model=model, classes=CLASSES, path=tmp_path / "teacher", retrained=False)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "store"
    fill(directory, tracks=3, per_track=4)
    return directory


def _report(store_dir: Path, teacher: Teacher) -> tuple[Report, str]:
    """The report the CLI makes for ``store_dir``, and its printed table."""
    store, _ = Store.open(store_dir, create=False)
    with store:
        report = evaluate_store(store, teacher, CLASSES, META)
    with insitu_cli.console.capture() as captured:
        insitu_cli._print_report(report, {})
    return report, captured.get()


def test_no_checkpoint_reports_no_student_accuracy(store_dir: Path, tmp_path: Path) -> None:
    report, text = _report(store_dir, _teacher(tmp_path))
    assert report.teacher_accuracy is not None and report.heldout_crops > 0
    assert report.student_accuracy is None and report.off_axis_student is None
    assert report.by_angle and all(b.student is None for b in report.by_angle)
    assert json.loads(json.dumps(report.to_json()))["student_accuracy"] is None
    assert "no student has trained yet" in text
    everything = [line for line in text.splitlines() if "│ all" in line]
    assert len(everything) == 1 and f"{100 * report.teacher_accuracy:.1f} %" in everything[0]
    assert everything[0].count("%") == 1  # the teacher's accuracy only; the student's is "-"


def test_a_checkpoint_of_step_0_is_not_a_trained_student(store_dir: Path, tmp_path: Path) -> None:
    store, _ = Store.open(store_dir)
    with store:
        train_student(store, CLASSES, teacher_state(), replace(TEST_CONFIG, epochs=1))
    state = load_state(store_dir / CHECKPOINT, CHECKPOINT_KEYS)
    save_state(store_dir / CHECKPOINT, {**state, "step": 0, "model": teacher_state()})
    report, text = _report(store_dir, _teacher(tmp_path))
    assert report.student_steps == 0
    assert report.student_accuracy is None
    assert all(b.student is None for b in report.by_angle)
    assert "no student has trained yet" in text


def test_a_trained_student_is_reported(store_dir: Path, tmp_path: Path) -> None:
    store, _ = Store.open(store_dir)
    with store:
        result = train_student(store, CLASSES, teacher_state(), replace(TEST_CONFIG, epochs=1))
    assert result.step > 0
    report, text = _report(store_dir, _teacher(tmp_path))
    assert report.student_accuracy is not None
    assert all(b.student is not None for b in report.by_angle)
    assert "no student has trained yet" not in text
