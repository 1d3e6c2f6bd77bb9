"""The camera node's loop, end to end: capture and label the video, store the crops, train the
student while the CPU is idle, evaluate and draw the picture. Resumable: a run on the same store
continues both the video and the training. ``edgetrain insitu`` is a thin command over
:func:`run` and :func:`evaluate_store`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.insitu.capture import CaptureProgress, capture
from edgetrain.insitu.evaluate import Report, evaluate, picture
from edgetrain.insitu.network import classifier
from edgetrain.insitu.scene import SyntheticScene, VideoSource, open_video
from edgetrain.insitu.store import Store, StoreError, count_reasons
from edgetrain.insitu.student import (
    CHECKPOINT,
    TrainConfig,
    TrainResult,
    load_student,
    plan_batch,
    train_student,
)
from edgetrain.insitu.teacher import LabelRule, load_teacher
from edgetrain.jsonfile import parse_json


class Bars(Protocol):
    """Where a run reports its progress (rich's ``Progress`` has this shape)."""

    def add_task(self, description: str, total: int | None = None, **fields: Any) -> Any: ...

    def update(self, key: Any, **fields: Any) -> None: ...


@dataclass(frozen=True)
class RunOptions:
    """What one run is asked to do.

    Attributes:
        store_dir: the store's directory (created if needed).
        video: a video file or a folder of frames; None: the synthetic scene.
        seed: the synthetic scene's seed.
        frames: the synthetic scene's frames.
        classes: kinds of object.
        teacher_views: canonical views per class the teacher trains on (once, then cached).
        minutes: wall-time limit for capture and training, counted from the start.
        store_cap_bytes: most image bytes to keep (None: no limit).
        config: how the student trains (memory, recompute factor, batch, epochs, ...).
    """

    store_dir: str
    video: str | None
    seed: int
    frames: int
    classes: int
    teacher_views: int
    minutes: float
    store_cap_bytes: int | None
    config: TrainConfig


def source_meta(options: RunOptions) -> dict[str, Any]:
    """The video source as the store records it (a run on the store must use the same)."""
    common = {"classes": options.classes, "teacher_views": options.teacher_views}
    if options.video is not None:
        return {"kind": "video", "path": str(Path(options.video).resolve()), **common}
    return {"kind": "synthetic", "seed": options.seed, "frames": options.frames, **common}


def open_source(meta: dict[str, Any]) -> SyntheticScene | VideoSource:
    """The video a source record names."""
    if meta["kind"] == "video":
        return open_video(meta["path"])
    return SyntheticScene(meta["seed"], frames=meta["frames"], classes=meta["classes"])


def stored_source(store: Store) -> dict[str, Any]:
    """The source record a store was filled from (CorruptFile when it is damaged)."""
    text = store.get("source")
    if text is None:
        raise StoreError(f"{store.directory} has no recorded video source; run `insitu run` first")
    try:
        meta = parse_json(text, "the store's source record", "")
    except CorruptFile as exc:
        raise CorruptFile(f"{store.directory}: the store's source record is unreadable") from exc
    if not isinstance(meta, dict) or meta.get("kind") not in ("video", "synthetic"):
        raise CorruptFile(f"{store.directory}: the store's source record is unreadable")
    return meta


def skipped_rows(store: Store, classes: int) -> dict[str, int]:
    """How many rows of the store's database the store skips, by reason (see Store.rows)."""
    _, skipped = store.rows(classes)
    return count_reasons([s.reason for s in skipped])


def skipped_note(skipped: dict[str, int]) -> str:
    """The report's note on rows skipped as corrupt."""
    reasons = ", ".join(f"{reason}: {n}" for reason, n in skipped.items())
    return (
        f"{sum(skipped.values())} rows of the store were skipped, not trained on ({reasons}); "
        "the store never reads or deletes a file its rows name outside it"
    )


def evaluate_store(store: Store, teacher: Any, classes: int, meta: dict[str, Any]) -> Report:
    """Teacher against the student the store's checkpoint holds (none before its first step)."""
    student = None
    steps = (0, 0)
    if (store.directory / CHECKPOINT).exists():
        trained, state = load_student(store.directory, classes)
        steps = (int(state["step"]), int(state["total_steps"]))
        if steps[0] > 0:  # a checkpoint of step 0 holds the teacher's weights: no student yet
            student = trained
    scene = open_source(meta) if meta["kind"] == "synthetic" else None
    assert scene is None or isinstance(scene, SyntheticScene)
    return evaluate(store, teacher, student, scene, student_steps=steps)


def _open_notes(cleaned: Any) -> list[str]:
    notes = []
    if cleaned.orphans_removed or cleaned.temporaries_removed:
        notes.append(
            f"cleaned up an interrupted write: {cleaned.orphans_removed} unindexed images, "
            f"{cleaned.temporaries_removed} temporary files"
        )
    if cleaned.rows_repaired:
        notes.append(
            f"{cleaned.rows_repaired} rows had a damaged image name; restored from their "
            "checksums, their images kept"
        )
    return notes


def _capture(
    source: Any, store: Store, teacher: Any, bars: Bars, deadline: float
) -> CaptureProgress:
    f_task = bars.add_task("frames", total=len(source) or None, info="")
    t_task = bars.add_task("tracks", total=None, info="")
    i_task = bars.add_task("labelled images", total=None, info="")

    def on_frame(p: Any) -> None:
        bars.update(f_task, completed=p.frames)
        info = f"{p.labelled_tracks} labelled, {p.dropped_tracks} dropped"
        bars.update(t_task, completed=p.tracks, info=info)
        bars.update(i_task, completed=p.images)

    progress = capture(source, store, teacher, LabelRule(), deadline=deadline, on_frame=on_frame)
    on_frame(progress)
    bars.update(f_task, total=progress.frames if progress.finished else len(source))
    return progress


def _train(
    store: Store, teacher: Any, options: RunOptions, bars: Bars, deadline: float
) -> TrainResult:
    s_task = bars.add_task("training steps", total=None, info="waiting for capture")

    def on_step(step: int, total: int, loss: float, paused: bool) -> None:
        info = "paused: CPU busy" if paused else f"loss {loss:.3f}"
        bars.update(s_task, completed=step, total=total, info=info)

    return train_student(
        store,
        options.classes,
        teacher.model.state_dict(),
        options.config,
        deadline=deadline,
        on_step=on_step,
    )


def _result_notes(
    progress: CaptureProgress, result: TrainResult | None, total: int, skipped: dict[str, int]
) -> list[str]:
    notes = []
    if not progress.finished:
        notes.append(f"time ran out at frame {progress.frames} of {total}; run again to resume")
    if skipped:
        notes.append(skipped_note(skipped))
    if result is not None and result.skipped_images:
        notes.append(
            f"{result.skipped_images} stored images were unreadable or failed their checksum "
            "and were skipped, not trained on"
        )
    if result is not None and not result.finished:
        notes.append(
            f"the student has trained {result.step} of {result.total_steps} steps (paused "
            f"{result.paused_seconds:.0f} s while other processes kept the CPU busy); run "
            "again to resume, or pass --idle-threshold 1 to train regardless of load"
        )
    return notes


def run(
    options: RunOptions, bars: Bars, note: Callable[[str], None] = lambda _: None
) -> tuple[Report, dict[str, Any]]:
    """Capture, label, store, train the student when idle, evaluate, draw the picture.

    Everything that can be refused (an unreadable video, a budget no batch fits, a store filled
    from another source) is refused before any long work. Returns the report and the run's
    figures and notes (what ``insitu run --json`` prints)."""
    deadline = time.monotonic() + 60 * options.minutes
    config = options.config
    meta = source_meta(options)
    source = open_source(meta)
    batch_plan = plan_batch(classifier(options.classes), config, find_largest=True)
    store, cleaned = Store.open(options.store_dir, cap_bytes=options.store_cap_bytes)
    with store:
        previous = store.get("source")
        if previous is not None and stored_source(store) != meta:
            raise InvalidInput(
                f"the store {options.store_dir} was filled from {previous}; use the same source "
                "or a new --store"
            )
        store.set(source=json.dumps(meta))
        notes = _open_notes(cleaned)
        note("teacher: loading (trained once on canonical views, then cached)")
        teacher = load_teacher(options.classes, per_class=options.teacher_views)
        if teacher.retrained:
            notes.append(f"teacher trained on canonical views and cached in {teacher.path}")
        progress = _capture(source, store, teacher, bars, deadline)
        result = None
        if store.count() == 0 and not progress.finished:
            notes.append("no labelled images yet: run again to continue the video")
        else:
            result = _train(store, teacher, options, bars, deadline)
        if result is not None:
            skipped = result.skipped_rows
        else:
            skipped = skipped_rows(store, options.classes)
        notes += _result_notes(progress, result, len(source), skipped)
        report = evaluate_store(store, teacher, options.classes, meta)
        picture_path = store.directory / "insitu.png"
        scene = source if isinstance(source, SyntheticScene) else None
        picture(report, store, scene, picture_path)
    data: dict[str, Any] = {
        **report.to_json(),
        "frames": progress.frames,
        "video_finished": progress.finished,
        "tracks": progress.tracks,
        "labelled_tracks": progress.labelled_tracks,
        "dropped_tracks": progress.dropped_tracks,
        "memory_bytes": config.memory_bytes,
        "batch": batch_plan.batch,
        "largest_fitting_batch": batch_plan.largest_fitting,
        "plan_recompute_factor": batch_plan.recompute_factor,
        "predicted_peak_bytes": result.predicted_peak_bytes if result else None,
        "measured_peak_bytes": result.measured_peak_bytes if result else None,
        "training_finished": bool(result and result.finished),
        "paused_seconds": result.paused_seconds if result else 0.0,
        "skipped_images": result.skipped_images if result else 0,
        "skipped_rows": {"count": sum(skipped.values()), "reasons": skipped},
        "picture": str(picture_path),
        "notes": notes,
    }
    return report, data


def evaluate_run(store_dir: str, picture_path: str | None) -> tuple[Report, dict[str, Any]]:
    """The report on a store (``insitu eval``): teacher against student, the picture, and the
    rows skipped as corrupt."""
    store, _ = Store.open(store_dir, create=False)
    with store:
        meta = stored_source(store)
        if store.count() == 0:
            raise StoreError(f"the store {store_dir} holds no images yet; run `insitu run` first")
        classes = int(meta["classes"])
        teacher = load_teacher(classes, per_class=int(meta["teacher_views"]))
        report = evaluate_store(store, teacher, classes, meta)
        out = Path(picture_path) if picture_path else store.directory / "insitu.png"
        scene = open_source(meta) if meta["kind"] == "synthetic" else None
        picture(report, store, scene if isinstance(scene, SyntheticScene) else None, out)
        skipped = skipped_rows(store, classes)
    rows = {"count": sum(skipped.values()), "reasons": skipped}
    notes = [skipped_note(skipped)] if skipped else []
    return report, {"picture": str(out), "skipped_rows": rows, "notes": notes}
