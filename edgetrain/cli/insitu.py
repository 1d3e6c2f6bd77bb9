"""``edgetrain insitu``: the camera node's student-teacher loop (paper §III), end to end.

``insitu run`` reads video (a synthetic fixed-camera scene by default, or ``--video``), labels
tracks with the cached teacher, stores the crops, trains the student within ``--memory`` while the
CPU is idle, then prints the evaluation and writes the picture. Run it again on the same
``--store`` and it resumes both the video and the training. ``insitu eval`` reports on a store.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edgetrain import progress as progress_api
from edgetrain.cli.options import (
    BATCH,
    NON_NEGATIVE,
    RECOMPUTE,
    FiniteRange,
    OutputFile,
)
from edgetrain.cli.output import console, emit_json, table
from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.insitu.capture import capture
from edgetrain.insitu.evaluate import Report, evaluate, picture
from edgetrain.insitu.network import classifier
from edgetrain.insitu.scene import (
    CLASS_NAMES,
    MAX_FRAMES,
    SyntheticScene,
    VideoSource,
    open_video,
)
from edgetrain.insitu.store import Store, StoreError, count_reasons
from edgetrain.insitu.student import (
    CHECKPOINT,
    TrainConfig,
    load_student,
    plan_batch,
    train_student,
)
from edgetrain.insitu.teacher import LabelRule, load_teacher
from edgetrain.jsonfile import parse_json
from edgetrain.units import format_bytes, parse_bytes

MAX_MINUTES = 7 * 24 * 60
"""Longest ``--minutes`` of one ``insitu run`` (a week; a later run resumes)."""


@click.group(name="insitu")
def insitu() -> None:
    """In-situ student-teacher training on a fixed camera node."""


def _source_meta(
    video: str | None, seed: int, frames: int, classes: int, teacher_views: int
) -> dict[str, Any]:
    common = {"classes": classes, "teacher_views": teacher_views}
    if video is not None:
        return {"kind": "video", "path": str(Path(video).resolve()), **common}
    return {"kind": "synthetic", "seed": seed, "frames": frames, **common}


def _open_source(meta: dict[str, Any]) -> SyntheticScene | VideoSource:
    if meta["kind"] == "video":
        return open_video(meta["path"])
    return SyntheticScene(meta["seed"], frames=meta["frames"], classes=meta["classes"])


def _stored_source(store: Store) -> dict[str, Any]:
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


@insitu.command(name="run")
@click.option("--video", type=str, default=None, help="A video file or a folder of frames.")
@click.option("--synthetic", is_flag=True, help="Use the synthetic camera scene (the default).")
@click.option(
    "--seed", default=0, show_default=True, type=NON_NEGATIVE, help="Synthetic scene seed."
)
@click.option(
    "--frames",
    default=2000,
    show_default=True,
    type=click.IntRange(1, MAX_FRAMES),
    help=f"Synthetic frames, at most {MAX_FRAMES:,}.",
)
@click.option(
    "--classes",
    default=4,
    show_default=True,
    type=click.IntRange(2, len(CLASS_NAMES)),
    help="Kinds of object (the teacher knows the synthetic scene's).",
)
@click.option(
    "--minutes",
    default=10.0,
    show_default=True,
    type=FiniteRange(0, MAX_MINUTES, min_open=True),
    help=f"Wall-time limit for capture and training, counted from the start (at most "
    f"{MAX_MINUTES:,}: a week).",
)
@click.option("--memory", default="2GB", show_default=True, help="Device memory for training.")
@click.option("--store", "store_dir", required=True, help="Store directory (created if needed).")
@click.option("--store-cap", default=None, help="Most image bytes to keep, e.g. 8GB.")
@click.option("--recompute", default=1.25, show_default=True, type=RECOMPUTE)
@click.option("--epochs", default=3, show_default=True, type=int)
@click.option("--max-batch", default=32, show_default=True, type=BATCH)
@click.option("--checkpoint-every", default=10, show_default=True, type=int)
@click.option("--threads", default=2, show_default=True, type=int)
@click.option(
    "--idle-threshold",
    default=0.75,
    show_default=True,
    type=FiniteRange(0, 1, min_open=True),
    help="Pause training while other processes use more than this share of all cores (1: never).",
)
@click.option(
    "--teacher-views",
    default=400,
    show_default=True,
    type=int,
    help="Canonical views per class the teacher is trained on (once, then cached).",
)
@click.option("--json", "as_json", is_flag=True)
def run_command(
    video: str | None,
    synthetic: bool,
    seed: int,
    frames: int,
    classes: int,
    minutes: float,
    memory: str,
    store_dir: str,
    store_cap: str | None,
    recompute: float,
    epochs: int,
    max_batch: int,
    checkpoint_every: int,
    threads: int,
    idle_threshold: float,
    teacher_views: int,
    as_json: bool,
) -> None:
    """Capture, label, store, train the student when idle, evaluate; resumable."""
    deadline = time.monotonic() + 60 * minutes
    if video is not None and synthetic:
        raise InvalidInput("give --video PATH or --synthetic, not both")
    for name, value in (
        ("--epochs", epochs),
        ("--max-batch", max_batch),
        ("--checkpoint-every", checkpoint_every),
        ("--threads", threads),
        ("--frames", frames),
        ("--teacher-views", teacher_views),
    ):
        if value < 1:
            raise InvalidInput(f"{name} must be at least 1, got {value}")
    config = TrainConfig(
        memory_bytes=parse_bytes(memory),
        recompute=recompute,
        max_batch=max_batch,
        epochs=epochs,
        checkpoint_every=checkpoint_every,
        threads=threads,
        idle_threshold=idle_threshold,
    )
    # Fail on an unreadable video or an infeasible budget before any long work.
    meta = _source_meta(video, seed, frames, classes, teacher_views)
    source = _open_source(meta)
    batch_plan = plan_batch(classifier(classes), config, find_largest=True)
    store, cleaned = Store.open(store_dir, cap_bytes=parse_bytes(store_cap) if store_cap else None)
    with store:
        previous = store.get("source")
        if previous is not None and _stored_source(store) != meta:
            raise InvalidInput(
                f"the store {store_dir} was filled from {previous}; use the same source or a new "
                "--store"
            )
        store.set(source=json.dumps(meta))
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
        if not as_json:
            progress_api.note("teacher: loading (trained once on canonical views, then cached)")
        teacher = load_teacher(classes, per_class=teacher_views)
        if teacher.retrained:
            notes.append(f"teacher trained on canonical views and cached in {teacher.path}")
        with contextlib.ExitStack() as stack:
            bars = _bars(stack, as_json)
            f_task = bars.add_task("frames", total=len(source) or None, info="")
            t_task = bars.add_task("tracks", total=None, info="")
            i_task = bars.add_task("labelled images", total=None, info="")
            s_task = bars.add_task("training steps", total=None, info="waiting for capture")

            def on_frame(p: Any) -> None:
                bars.update(f_task, completed=p.frames)
                bars.update(
                    t_task,
                    completed=p.tracks,
                    info=f"{p.labelled_tracks} labelled, {p.dropped_tracks} dropped",
                )
                bars.update(i_task, completed=p.images)

            progress = capture(
                source, store, teacher, LabelRule(), deadline=deadline, on_frame=on_frame
            )
            on_frame(progress)
            bars.update(f_task, total=progress.frames if progress.finished else len(source))

            def on_step(step: int, total: int, loss: float, paused: bool) -> None:
                info = "paused: CPU busy" if paused else f"loss {loss:.3f}"
                bars.update(s_task, completed=step, total=total, info=info)

            result = None
            if store.count() == 0 and not progress.finished:
                notes.append("no labelled images yet: run again to continue the video")
            else:
                result = train_student(
                    store,
                    classes,
                    teacher.model.state_dict(),
                    config,
                    deadline=deadline,
                    on_step=on_step,
                )
        if not progress.finished:
            notes.append(
                f"time ran out at frame {progress.frames} of {len(source)}; run again to resume"
            )
        skipped = result.skipped_rows if result is not None else _skipped_rows(store, classes)
        if skipped:
            notes.append(_skipped_note(skipped))
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
        report = _evaluate(store, teacher, classes, meta)
        picture_path = store.directory / "insitu.png"
        picture(report, store, source if isinstance(source, SyntheticScene) else None, picture_path)
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
    if as_json:
        emit_json(data)
        return
    _print_report(report, data)


def _skipped_rows(store: Store, classes: int) -> dict[str, int]:
    """How many rows of the store's database the store skips, by reason (see Store.rows)."""
    _, skipped = store.rows(classes)
    return count_reasons([s.reason for s in skipped])


def _skipped_note(skipped: dict[str, int]) -> str:
    reasons = ", ".join(f"{reason}: {n}" for reason, n in skipped.items())
    return (
        f"{sum(skipped.values())} rows of the store were skipped, not trained on ({reasons}); "
        "the store never reads or deletes a file its rows name outside it"
    )


def _evaluate(store: Store, teacher: Any, classes: int, meta: dict[str, Any]) -> Report:
    student = None
    steps = (0, 0)
    if (store.directory / CHECKPOINT).exists():
        trained, state = load_student(store.directory, classes)
        steps = (int(state["step"]), int(state["total_steps"]))
        if steps[0] > 0:  # a checkpoint of step 0 holds the teacher's weights: no student yet
            student = trained
    scene = _open_source(meta) if meta["kind"] == "synthetic" else None
    assert scene is None or isinstance(scene, SyntheticScene)
    return evaluate(store, teacher, student, scene, student_steps=steps)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _points(student: float | None, teacher: float | None) -> str:
    """The student's lead over the teacher in percentage points ("-" without a student)."""
    if student is None or teacher is None:
        return "-"
    return f"{100 * (student - teacher):+.1f}"


def _print_report(report: Report, extra: dict[str, Any]) -> None:
    rows = [
        [
            f"{b.from_deg:.0f}-{b.to_deg:.0f}",
            b.n,
            _pct(b.teacher),
            _pct(b.student),
            _points(b.student, b.teacher),
        ]
        for b in report.by_angle
    ]
    rows.append(
        [
            "all",
            report.heldout_crops,
            _pct(report.teacher_accuracy),
            _pct(report.student_accuracy),
            "",
        ]
    )
    rows.append(
        [
            ">= 45 (off-axis)",
            "",
            _pct(report.off_axis_teacher),
            _pct(report.off_axis_student),
            _points(report.off_axis_student, report.off_axis_teacher),
        ]
    )
    console.print(
        table(
            "teacher vs student on held-out frames, by off-axis angle",
            ["angle (deg)", "n", "teacher", "student", "points"],
            rows,
        )
    )
    facts = [
        [
            "propagated labels: precision / recall",
            f"{_pct(report.label_precision)} / {_pct(report.label_recall)}",
        ],
        ["crops tracked / labelled", f"{report.tracked_crops} / {report.labelled_crops}"],
        ["images stored, mean size", f"{report.images}, {report.mean_image_bytes / 1000:.2f} KB"],
        ["student steps", f"{report.student_steps} / {report.student_total_steps}"],
    ]
    if "skipped_rows" in extra:
        count = extra["skipped_rows"]["count"]
        reasons = "; ".join(f"{r}: {n}" for r, n in extra["skipped_rows"]["reasons"].items())
        facts.append(["rows skipped (corrupt)", f"{count}" + (f" ({reasons})" if count else "")])
    if "batch" in extra:
        facts += [
            ["memory budget", format_bytes(extra["memory_bytes"])],
            [
                "batch (largest fitting at rho)",
                f"{extra['batch']} ({extra['largest_fitting_batch']}, rho "
                f"{extra['plan_recompute_factor']:.3f})",
            ],
        ]
        if extra.get("measured_peak_bytes"):
            facts.append(
                [
                    "training peak: measured / predicted",
                    f"{format_bytes(extra['measured_peak_bytes'])} / "
                    f"{format_bytes(extra['predicted_peak_bytes'])}",
                ]
            )
    if "picture" in extra:
        facts.append(["picture", extra["picture"]])
    console.print(table("in-situ store", ["", "value"], facts))
    if report.student_accuracy is None and report.teacher_accuracy is not None:
        console.print("note: no student has trained yet; its columns show '-'")
    for note in extra.get("notes", []):
        console.print(f"note: {note}")


@insitu.command(name="eval")
@click.option("--store", "store_dir", required=True)
@click.option(
    "--picture",
    "picture_path",
    type=OutputFile(".png"),
    default=None,
    help="PNG path (default DIR/insitu.png).",
)
@click.option("--json", "as_json", is_flag=True)
def eval_command(store_dir: str, picture_path: str | None, as_json: bool) -> None:
    """Teacher vs student by off-axis angle, label precision/recall, images and bytes."""
    torch.set_num_threads(2)
    store, _ = Store.open(store_dir, create=False)
    with store:
        meta = _stored_source(store)
        if store.count() == 0:
            raise StoreError(f"the store {store_dir} holds no images yet; run `insitu run` first")
        teacher = load_teacher(int(meta["classes"]), per_class=int(meta["teacher_views"]))
        report = _evaluate(store, teacher, int(meta["classes"]), meta)
        out = Path(picture_path) if picture_path else store.directory / "insitu.png"
        scene = _open_source(meta) if meta["kind"] == "synthetic" else None
        picture(report, store, scene if isinstance(scene, SyntheticScene) else None, out)
        skipped = _skipped_rows(store, int(meta["classes"]))
    rows = {"count": sum(skipped.values()), "reasons": skipped}
    if as_json:
        emit_json({**report.to_json(), "skipped_rows": rows})
        return
    notes = [_skipped_note(skipped)] if skipped else []
    _print_report(report, {"picture": str(out), "skipped_rows": rows, "notes": notes})


class _LoggedBars:
    """``rich.progress.Progress``'s ``add_task`` / ``update`` as :mod:`edgetrain.progress`
    tasks: lines on stderr when it is not a terminal (a bar each when it is one)."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._tasks: list[progress_api.Task] = []

    def add_task(self, description: str, total: int | None = None, **_fields: Any) -> int:
        self._tasks.append(self._stack.enter_context(progress_api.task(description, total)))
        return len(self._tasks) - 1

    def update(
        self,
        key: int,
        *,
        completed: int | None = None,
        total: int | None = None,
        info: str | None = None,
    ) -> None:
        task = self._tasks[key]
        if total is not None:
            task.total = total
        task(0 if completed is None else completed - task.completed, detail=info)


def _bars(stack: contextlib.ExitStack, as_json: bool) -> Any:
    """The progress of a run, on stderr only (stdout holds the report and the JSON): rich's
    four bars on a terminal, else timestamped lines; none with ``--json``."""
    if as_json:
        stack.enter_context(progress_api.quiet())
    errors = Console(stderr=True)
    if as_json or not errors.is_terminal:
        return _LoggedBars(stack)
    return stack.enter_context(
        Progress(
            TextColumn("{task.description:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=errors,
            transient=False,
        )
    )
