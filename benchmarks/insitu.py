"""In-situ student-teacher training: every in-situ figure measured in one run.

    python benchmarks/insitu.py [--store DIR] [--kills 20] [--json]

1. Accuracy: the pipeline on the default synthetic scene (capture, label, store, train, eval);
   with ``--store`` an existing store from ``edgetrain insitu run`` is evaluated (and resumed).
   Targets: student beats teacher by >= 20 points at >= 45 deg off axis; label precision >= 95 %;
   <= 10 KB per stored image.
2. Memory: a few student steps at the default 2 GB budget and at a budget the planner must
   squeeze (the largest batch fitting 16 MB); the measured peak (live tensor storages) must be
   within the budget and equal to the plan's prediction +-5 %.
3. Idle gating: while the student trains, one busy process per core starts; the time until
   training pauses, and until it resumes after they stop.
4. kill -9: ``--kills`` random kills, half while a video is captured into a store, half while the
   student trains; every resume must succeed, every row's image verify, no crop be stored twice,
   and the final weights equal an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit

from edgetrain.insitu.capture import capture
from edgetrain.insitu.evaluate import evaluate
from edgetrain.insitu.files import load_state
from edgetrain.insitu.network import classifier
from edgetrain.insitu.scene import SyntheticScene
from edgetrain.insitu.store import Store
from edgetrain.insitu.student import (
    CHECKPOINT,
    TrainConfig,
    load_student,
    plan_at,
    train_student,
)
from edgetrain.insitu.teacher import LabelRule, load_teacher

CLASSES = 4
KILL_FRAMES = 1000
KILL_CONFIG = TrainConfig(
    max_batch=16, epochs=2, checkpoint_every=3, threads=1, idle_threshold=1.0, low_priority=False
)


def accuracy(store_dir: Path) -> dict[str, Any]:
    teacher = load_teacher(CLASSES)
    scene = SyntheticScene(0, frames=2000, classes=CLASSES)
    store, _ = Store.open(store_dir)
    with store:
        if store.get("capture_done") is None:
            capture(scene, store, teacher, LabelRule())
        config = TrainConfig(threads=2, idle_threshold=1.0, epochs=3, low_priority=False)
        result = train_student(store, CLASSES, teacher.model.state_dict(), config)
        student, state = load_student(store_dir, CLASSES)
        report = evaluate(
            store, teacher, student, scene, student_steps=(state["step"], result.total_steps)
        )
    return report.to_json()


def memory(store_dir: Path) -> list[dict[str, Any]]:
    rows = []
    model = classifier(CLASSES)
    tight = plan_at(model, 1, TrainConfig()).predicted_peak_bytes
    squeeze = max(16 * 2**20, tight)
    for name, budget, cap in (("2 GB, batch cap 32", 2 * 1024**3, 32), ("16 MB", squeeze, 10_000)):
        work = Path(tempfile.mkdtemp(prefix="insitu-mem-"))
        shutil.copytree(store_dir, work / "s", ignore=shutil.ignore_patterns(CHECKPOINT))
        store, _ = Store.open(work / "s")
        config = TrainConfig(
            memory_bytes=budget,
            max_batch=cap,
            threads=2,
            idle_threshold=1.0,
            low_priority=False,
            epochs=1,
        )
        teacher = load_teacher(CLASSES)
        with store:
            result = train_student(
                store, CLASSES, teacher.model.state_dict(), config, deadline=time.monotonic() + 20
            )
        shutil.rmtree(work)
        rows.append(
            {
                "budget": name,
                "budget_bytes": budget,
                "batch": result.batch,
                "predicted_peak_bytes": result.predicted_peak_bytes,
                "measured_peak_bytes": result.measured_peak_bytes,
                "measured/predicted": result.measured_peak_bytes / result.predicted_peak_bytes,
                "within_budget": result.measured_peak_bytes <= budget,
            }
        )
    return rows


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


def idle_gate(store_dir: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="insitu-idle-"))
    shutil.copytree(store_dir, work / "s", ignore=shutil.ignore_patterns(CHECKPOINT))
    events: list[tuple[float, bool]] = []
    teacher = load_teacher(CLASSES)
    config = TrainConfig(threads=1, epochs=1, low_priority=True, idle_threshold=0.75)
    deadline = time.monotonic() + 40

    def train() -> None:
        store, _ = Store.open(work / "s")
        with store:
            train_student(
                store,
                CLASSES,
                teacher.model.state_dict(),
                config,
                deadline=deadline,
                on_step=lambda s, t, loss, paused: events.append((time.monotonic(), paused)),
            )

    worker = threading.Thread(target=train)
    worker.start()
    while not events and worker.is_alive():
        time.sleep(0.1)
    time.sleep(4)
    paused_before = any(p for t, p in events[-5:])
    stop = multiprocessing.get_context("spawn").Event()
    spinners = [
        multiprocessing.get_context("spawn").Process(target=_spin, args=(stop,))
        for _ in range(os.cpu_count() or 1)
    ]
    load_at = time.monotonic()
    for p in spinners:
        p.start()
    while time.monotonic() < load_at + 15 and not any(p for t, p in events if t > load_at):
        time.sleep(0.05)
    paused_at = next((t for t, p in events if p and t > load_at), None)
    time.sleep(2)
    stop.set()
    for p in spinners:
        p.join()
    free_at = time.monotonic()
    while time.monotonic() < free_at + 15 and not any(not p for t, p in events if t > free_at):
        time.sleep(0.05)
    resumed_at = next((t for t, p in events if not p and t > free_at), None)
    worker.join()
    shutil.rmtree(work)
    if paused_before:  # the machine was already busy: no pause the benchmark caused to time
        paused_at = None
    return {
        "paused_before_load": paused_before,
        "pause_seconds": None if paused_at is None else paused_at - load_at,
        "resume_seconds": None if resumed_at is None else resumed_at - free_at,
    }


def _child(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE)


def _verify(store_dir: Path) -> tuple[int, int]:
    """(rows, duplicate crops); raises on any corrupt row or image."""
    store, _ = Store.open(store_dir)
    with store:
        rows, problems = store.rows()
        assert not problems, problems
        for row in rows:
            store.read(row)
        files = {p.name for p in store.images_dir.iterdir()}
        assert files == {r.file for r in rows}, "unindexed image files after open"
        crops = store.crops()
        keys = [(c[0], c[1], c[2], c[3], c[4]) for c in crops]
        return len(rows), len(keys) - len(set(keys))


def kills(count: int, seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="insitu-kill-"))
    results: dict[str, Any] = {"store_kills": 0, "train_kills": 0, "resumes_ok": 0}
    # Store writes: capture a short video, killed at random moments, resumed each time.
    capture_dir = root / "capture"
    for _ in range(count // 2):
        child = _child(["capture", str(capture_dir)])
        assert child.stdout is not None
        child.stdout.readline()  # "ready": imports done
        time.sleep(rng.uniform(0.5, 4.0))
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            results["store_kills"] += 1
        child.wait()
        _verify(capture_dir)
        results["resumes_ok"] += 1
    final = _child(["capture", str(capture_dir)])
    assert final.wait() == 0
    rows, duplicates = _verify(capture_dir)
    results.update(store_rows=rows, duplicate_crops=duplicates)
    # Training: an uninterrupted run and a run killed count // 2 times.
    shutil.copytree(capture_dir, root / "whole", ignore=shutil.ignore_patterns(CHECKPOINT))
    shutil.copytree(capture_dir, root / "killed", ignore=shutil.ignore_patterns(CHECKPOINT))
    assert _child(["train", str(root / "whole")]).wait() == 0
    for _ in range(count - count // 2):
        child = _child(["train", str(root / "killed")])
        assert child.stdout is not None
        child.stdout.readline()
        time.sleep(rng.uniform(0.2, 4.0))
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            results["train_kills"] += 1
        child.wait()
        load_state(root / "killed" / CHECKPOINT) if (
            root / "killed" / CHECKPOINT
        ).exists() else None
        results["resumes_ok"] += 1
    assert _child(["train", str(root / "killed")]).wait() == 0
    a = load_state(root / "whole" / CHECKPOINT)
    b = load_state(root / "killed" / CHECKPOINT)
    results["steps"] = int(b["step"])
    results["weights_equal"] = a["step"] == b["step"] and all(
        torch.equal(v, b["model"][k]) for k, v in a["model"].items()
    )
    shutil.rmtree(root)
    return results


def child(command: str, where: Path) -> None:
    teacher = load_teacher(CLASSES)
    print("ready", flush=True)
    store, _ = Store.open(where)
    with store:
        if command == "capture":
            capture(
                SyntheticScene(3, frames=KILL_FRAMES, classes=CLASSES), store, teacher, LabelRule()
            )
        else:
            train_student(store, CLASSES, teacher.model.state_dict(), KILL_CONFIG)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=None, help="a store from `insitu run`")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only-kills", action="store_true", help="just the kill -9 part")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    if args.only_kills:
        emit(
            "kill -9 during store writes and training",
            ["what", "value"],
            [{"what": k, "value": v} for k, v in kills(args.kills).items()],
            args.json,
        )
        return
    store = args.store or Path(tempfile.mkdtemp(prefix="insitu-bench-")) / "store"
    report = accuracy(store)
    rows = [
        {
            "angle": f"{b['from_deg']:.0f}-{b['to_deg']:.0f}",
            "n": b["n"],
            "teacher": b["teacher"],
            "student": b["student"],
            "points": 100 * (b["student"] - b["teacher"]),
        }
        for b in report["by_angle"]
    ]
    mem = memory(store)
    gate = idle_gate(store)
    killed = kills(args.kills)
    gain = 100 * (report["off_axis_student"] - report["off_axis_teacher"])
    extra = {
        "off-axis (>= 45 deg) teacher -> student (target >= +20 points)": (
            f"{report['off_axis_teacher']:.3f} -> {report['off_axis_student']:.3f} "
            f"({gain:+.1f} points)"
        ),
        "label precision / recall (target precision >= 0.95)": (
            f"{report['label_precision']:.4f} / {report['label_recall']:.4f}"
        ),
        "images, mean bytes (target <= 10000)": (
            f"{report['images']}, {report['mean_image_bytes']:.0f}"
        ),
        "memory": mem,
        "idle gate": gate,
        "kill -9": killed,
    }
    emit(
        "teacher vs student on held-out frames by off-axis angle (accuracy)",
        ["angle", "n", "teacher", "student", "points"],
        rows,
        args.json,
        extra,
    )


if __name__ == "__main__":
    main()
