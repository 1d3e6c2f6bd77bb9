"""``edgetrain insitu``: the camera node's student-teacher loop (paper §III), end to end.

``insitu run`` reads video (a synthetic fixed-camera scene by default, or ``--video``), labels
tracks with the cached teacher, stores the crops, trains the student within ``--memory`` while the
CPU is idle, then prints the evaluation and writes the picture. Run it again on the same
``--store`` and it resumes both the video and the training. ``insitu eval`` reports on a store.
"""

from __future__ import annotations

import contextlib
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
from edgetrain.errors import InvalidInput
from edgetrain.insitu.evaluate import Report
from edgetrain.insitu.pipeline import RunOptions, evaluate_run, run
from edgetrain.insitu.scene import (
    CLASS_NAMES,
    MAX_FRAMES,
)
from edgetrain.insitu.student import (
    TrainConfig,
)
from edgetrain.units import format_bytes, parse_bytes

MAX_MINUTES = 7 * 24 * 60
"""Longest ``--minutes`` of one ``insitu run`` (a week; a later run resumes)."""


@click.group(name="insitu")
def insitu() -> None:
    """In-situ student-teacher training on a fixed camera node."""


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
    options = RunOptions(
        store_dir=store_dir,
        video=video,
        seed=seed,
        frames=frames,
        classes=classes,
        teacher_views=teacher_views,
        minutes=minutes,
        store_cap_bytes=parse_bytes(store_cap) if store_cap else None,
        config=TrainConfig(
            memory_bytes=parse_bytes(memory),
            recompute=recompute,
            max_batch=max_batch,
            epochs=epochs,
            checkpoint_every=checkpoint_every,
            threads=threads,
            idle_threshold=idle_threshold,
        ),
    )
    with contextlib.ExitStack() as stack:
        bars = _bars(stack, as_json)
        report, data = run(options, bars, note=progress_api.note)
    if as_json:
        emit_json(data)
        return
    _print_report(report, data)


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
    report, data = evaluate_run(store_dir, picture_path)
    if as_json:
        emit_json({**report.to_json(), "skipped_rows": data["skipped_rows"]})
        return
    _print_report(report, data)


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
