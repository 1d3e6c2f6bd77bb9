"""Evaluation: teacher vs student on held-out frames of this camera, and the store's numbers.

Held-out frames are a second, independent stream of objects seen by the same synthetic camera
(``SyntheticScene(seed, stream=1)``): never detected, tracked or stored. Each object wholly in
view is cropped at its ground-truth box and classified by the teacher and by the student;
accuracies are binned by the absolute off-axis angle. Label precision and recall compare the
propagated labels of every tracked crop with ground truth: precision over the crops that got a
label, recall over the crops of a real object. :func:`picture` draws sample frames with their
tracks and the accuracy by angle as a PNG with Pillow.
"""

from __future__ import annotations

import io
import itertools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from PIL import Image, ImageDraw

from edgetrain.insitu.detect import square_crop
from edgetrain.insitu.files import atomic_write_bytes
from edgetrain.insitu.network import INPUT
from edgetrain.insitu.scene import MAX_ANGLE_DEG, SyntheticScene
from edgetrain.insitu.store import Store
from edgetrain.insitu.teacher import Teacher

BIN_DEG = 15.0
OFF_AXIS_DEG = 45.0  # "off-axis" in the summary: at least this far from the optical axis


@dataclass(frozen=True)
class AngleBin:
    """Accuracy (fraction correct) of teacher and student on ``n`` held-out crops.

    ``student`` is None when no student has trained yet: the report never shows the teacher's
    accuracy as the student's.
    """

    from_deg: float
    to_deg: float
    n: int
    teacher: float
    student: float | None


@dataclass(frozen=True)
class Report:
    """The eval report. Accuracies are fractions; bytes are bytes.

    Accuracies are None without ground truth (a real video); the student's are None too while no
    student has trained (no checkpoint, or one of step 0, which holds the teacher's weights).
    """

    teacher_accuracy: float | None
    student_accuracy: float | None
    off_axis_teacher: float | None
    off_axis_student: float | None
    by_angle: list[AngleBin]
    label_precision: float | None
    label_recall: float | None
    labelled_crops: int
    tracked_crops: int
    images: int
    mean_image_bytes: float
    stored_bytes: int
    student_steps: int
    student_total_steps: int
    heldout_crops: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def heldout(
    scene: SyntheticScene, frames: int, every: int = 2
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Ground-truth crops (INPUT x INPUT uint8) of held-out frames, labels and angles (degrees)."""
    other = SyntheticScene(
        scene.seed,
        frames=frames,
        width=scene.width,
        height=scene.height,
        classes=scene.classes,
        fps=scene.fps,
        stream=1,
    )
    crops, labels, angles = [], [], []
    for index in range(30, frames, every):
        frame = other.frame(index)
        for truth in frame.truth:
            if truth.inside:
                crops.append(square_crop(frame.image, truth.box, INPUT))
                labels.append(truth.label)
                angles.append(truth.angle_deg)
    return crops, np.array(labels), np.array(angles)


def _predict(model: Any, crops: list[np.ndarray]) -> np.ndarray:
    import torch

    from edgetrain.insitu.network import to_input

    out = []
    with torch.no_grad():
        for start in range(0, len(crops), 256):
            out.append(model(to_input(crops[start : start + 256])).argmax(dim=1).numpy())
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _accuracy(ok: np.ndarray | None, mask: np.ndarray | None) -> float | None:
    """The fraction of ``ok`` (under ``mask``) that is True; None for a model not evaluated."""
    if ok is None:
        return None
    return float((ok if mask is None else ok[mask]).mean())


def label_quality(store: Store) -> tuple[float | None, float | None, int, int]:
    """Precision and recall of the propagated labels against ground truth, and crop counts."""
    crops = store.crops()
    known = [c for c in crops if c[7] >= 0]
    labelled = [c for c in crops if c[6] >= 0]  # a label on a crop of no real object is wrong
    correct = sum(1 for c in labelled if c[6] == c[7])
    precision = correct / len(labelled) if labelled else None
    recall = correct / len(known) if known else None
    return precision, recall, sum(1 for c in crops if c[6] >= 0), len(crops)


def evaluate(
    store: Store,
    teacher: Teacher,
    student: Any | None,
    scene: SyntheticScene | None,
    *,
    heldout_frames: int | None = None,
    student_steps: tuple[int, int] = (0, 0),
) -> Report:
    """The report for a store (``scene`` None: a real video, no ground truth).

    ``student`` None: no student has trained yet; its accuracies are None, not the teacher's.
    """
    by_angle: list[AngleBin] = []
    teacher_acc = student_acc = off_t = off_s = None
    n = 0
    if scene is not None:
        frames = heldout_frames or min(scene.frames, 1000)
        crops, labels, angles = heldout(scene, frames)
        n = len(crops)
        t_ok = _predict(teacher.model, crops) == labels
        s_ok = _predict(student, crops) == labels if student is not None else None
        teacher_acc, student_acc = _accuracy(t_ok, None), _accuracy(s_ok, None)
        off = np.abs(angles) >= OFF_AXIS_DEG
        if off.any():
            off_t, off_s = _accuracy(t_ok, off), _accuracy(s_ok, off)
        edges = np.arange(0.0, MAX_ANGLE_DEG + BIN_DEG, BIN_DEG)
        for lo, hi in itertools.pairwise(edges):
            mask = (np.abs(angles) >= lo) & (np.abs(angles) < hi)
            if mask.any():
                teacher_bin = float(t_ok[mask].mean())
                student_bin = _accuracy(s_ok, mask)
                bin_ = AngleBin(float(lo), float(hi), int(mask.sum()), teacher_bin, student_bin)
                by_angle.append(bin_)
    precision, recall, labelled, tracked = label_quality(store)
    images = store.count()
    stored = store.total_bytes()
    return Report(
        teacher_accuracy=teacher_acc,
        student_accuracy=student_acc,
        off_axis_teacher=off_t,
        off_axis_student=off_s,
        by_angle=by_angle,
        label_precision=precision if scene is not None else None,
        label_recall=recall if scene is not None else None,
        labelled_crops=labelled,
        tracked_crops=tracked,
        images=images,
        mean_image_bytes=stored / images if images else 0.0,
        stored_bytes=stored,
        student_steps=student_steps[0],
        student_total_steps=student_steps[1],
        heldout_crops=n,
    )


def picture(report: Report, store: Store, scene: SyntheticScene | None, path: Path) -> None:
    """Sample frames with their tracks (left) and accuracy by angle (right), as a PNG written
    atomically; :class:`~edgetrain.insitu.files.DiskFull` when the disk has no room for it."""
    width, height = 320, 240
    panels: list[Image.Image] = []
    if scene is not None:
        crops = store.crops()
        frames = sorted({c[0] for c in crops})
        picks = [frames[len(frames) * k // 4] for k in (1, 2, 3)] if len(frames) >= 4 else frames
        for index in picks:
            frame = scene.frame(index)
            image = Image.fromarray(frame.image[..., ::-1].copy())
            draw = ImageDraw.Draw(image)
            for c in crops:
                if c[0] != index:
                    continue
                color = (40, 220, 40) if c[6] >= 0 and c[6] == c[7] else (230, 40, 40)
                if c[6] < 0:
                    color = (200, 200, 200)
                draw.rectangle(c[1:5], outline=color, width=2)
                name = scene.class_names[c[6]] if c[6] >= 0 else "dropped"
                label = f"t{c[5]} {name}"
                size = _text_size(draw, label)
                x, y = label_position(tuple(c[1:5]), size, image.size)
                draw.rectangle((x - 1, y - 1, x + size[0] + 1, y + size[1] + 1), fill=(0, 0, 0))
                write(draw, (x, y), label, color)
            write(draw, (4, 4), f"frame {index}", (255, 255, 255))
            panels.append(image.resize((width, height)))
    chart = _chart(report, height * max(1, len(panels)))
    left = Image.new("RGB", (width, chart.height), "white")
    for k, p in enumerate(panels):
        left.paste(p, (0, k * height))
    out = Image.new("RGB", (width + chart.width, chart.height), "white")
    out.paste(left, (0, 0))
    out.paste(chart, (width, 0))
    encoded = io.BytesIO()
    out.save(encoded, format="PNG")
    atomic_write_bytes(path, encoded.getvalue())  # a full disk is DiskFull, one line


AXIS_X = 44
"""The chart's y axis: room on its left for the scale's labels ("100 %")."""


def _chart(report: Report, height: int) -> Image.Image:
    """Accuracy by angle as bars, teacher beside student, on a 0-100 % scale."""
    chart = Image.new("RGB", (440, height), "white")
    draw = ImageDraw.Draw(chart)
    write(draw, (10, 8), "accuracy on held-out frames by off-axis angle", "black")
    legend = "grey: teacher   blue: student"
    if report.student_accuracy is None and report.teacher_accuracy is not None:
        legend = "grey: teacher   (no student trained yet)"
    write(draw, (10, 22), legend, "black")
    write(draw, (10, 34), "frames: green label right, red wrong, grey track dropped", "black")
    top, bottom = 64, chart.height - 40
    for percent in range(0, 101, 25):
        y = bottom - (bottom - top) * percent / 100
        draw.line((AXIS_X - 4, y, AXIS_X, y), fill="black")
        if percent:
            draw.line((AXIS_X + 1, y, chart.width - 10, y), fill=(225, 225, 225))
        label = f"{percent} %"
        write(draw, (AXIS_X - 6 - _text_size(draw, label)[0], y - 6), label, "black")
    if report.by_angle:
        slot = (chart.width - AXIS_X - 12) / len(report.by_angle)
        for k, b in enumerate(report.by_angle):
            x = AXIS_X + 2 + k * slot
            for j, (value, color) in enumerate(
                ((b.teacher, (150, 150, 150)), (b.student, (40, 90, 220)))
            ):
                if value is None:
                    continue
                h = (bottom - top) * value
                x0 = x + 6 + j * (slot - 12) / 2
                draw.rectangle((x0, bottom - h, x0 + (slot - 12) / 2 - 2, bottom), fill=color)
                write(draw, (x0, bottom - h - 12), f"{100 * value:.0f}", "black")
            write(draw, (x + 6, bottom + 6), f"{b.from_deg:.0f}-{b.to_deg:.0f} deg", "black")
    else:
        write(draw, (AXIS_X + 10, 60), "no ground truth (real video)", "black")
    draw.line((AXIS_X, top, AXIS_X, bottom), fill="black")
    draw.line((AXIS_X, bottom, chart.width - 10, bottom), fill="black")
    return chart


WORD_GAP = 4
"""Pixels between two words of a picture's text (the default font's space is 1-2 pixels)."""


def write(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, fill: Any) -> None:
    """Draw ``text`` at ``xy`` word by word, :data:`WORD_GAP` pixels apart at least."""
    x, y = xy
    for word in text.split():
        draw.text((x, y), word, fill=fill)
        x += _text_size(draw, word)[0] + WORD_GAP


def _text_size(draw: ImageDraw.ImageDraw, text: str) -> tuple[int, int]:
    """Width and height of ``text`` as :func:`write` draws it."""
    words = text.split()
    boxes = [draw.textbbox((0, 0), w) for w in words] or [(0, 0, 0, 0)]
    width = sum(b[2] - b[0] for b in boxes) + WORD_GAP * max(0, len(words) - 1)
    return int(width), int(max(b[3] for b in boxes))


def label_position(
    box: tuple[int, ...], size: tuple[int, int], frame: tuple[int, int]
) -> tuple[int, int]:
    """Where a track's label of ``size`` goes: above its ``box`` (x0, y0, x1, y1), or below it
    when there is no room above, moved left or down as far as needed to lie inside ``frame``."""
    (x0, y0, _, y1), (w, h), (fw, fh) = box, size, frame
    y = y0 - h - 2 if y0 - h - 2 >= 0 else y1 + 2
    return max(0, min(x0, fw - w - 1)), max(0, min(y, fh - h - 1))


def resize_for_model(crop: np.ndarray) -> np.ndarray:
    """A 224 x 224 crop at the classifiers' input size."""
    return cv2.resize(crop, (INPUT, INPUT), interpolation=cv2.INTER_AREA)
