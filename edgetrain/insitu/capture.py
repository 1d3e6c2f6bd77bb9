"""From video to labelled training set: detect, track, ask the teacher, label whole tracks, store.

Each frame: background subtraction gives boxes, the tracker links them to tracks, and the teacher
classifies every tracked crop. Crops wait in memory until their track ends; the
:class:`~edgetrain.insitu.teacher.LabelRule` then gives the whole track one label (or drops it),
and the store writes the track in one transaction.

Resuming: the store keeps ``frame_next``, the earliest frame of any track not yet stored. A rerun
starts there (after a warm-up of the background model on the frames before it) and skips any
detection that matches a crop already stored for that frame, so no track is stored twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import cv2
import numpy as np

from edgetrain.insitu.detect import CROP, Detector, iou, square_crop
from edgetrain.insitu.network import INPUT
from edgetrain.insitu.scene import Frame, SyntheticScene, VideoSource
from edgetrain.insitu.store import Crop, Store
from edgetrain.insitu.teacher import LabelRule, Teacher
from edgetrain.insitu.track import Tracker

WARMUP_FRAMES = 40  # frames the background model sees before a resumed run tracks again


@dataclass
class CaptureProgress:
    """Counts so far (this run and earlier runs on the same store)."""

    frames: int = 0
    total_frames: int = 0
    tracks: int = 0
    labelled_tracks: int = 0
    dropped_tracks: int = 0
    images: int = 0
    seconds: float = 0.0
    finished: bool = False
    notes: list[str] = field(default_factory=list)


def capture(
    source: SyntheticScene | VideoSource,
    store: Store,
    teacher: Teacher,
    rule: LabelRule,
    *,
    deadline: float | None = None,
    on_frame: Callable[[CaptureProgress], None] | None = None,
) -> CaptureProgress:
    """Process the video from where the store stopped until its end or ``deadline``
    (``time.monotonic()`` seconds)."""
    start = store.get_int("frame_next")
    progress = CaptureProgress(
        frames=start,
        total_frames=len(source),
        tracks=store.get_int("tracks"),
        labelled_tracks=store.get_int("labelled_tracks"),
        dropped_tracks=store.get_int("dropped_tracks"),
        images=store.count(),
    )
    began = time.monotonic()
    detector = Detector()
    tracker = Tracker(source.fps, first_id=store.get_int("next_track"))
    buffers: dict[int, list[Crop]] = {}
    first_frame: dict[int, int] = {}
    resumed = start > 0
    for frame in source.read(max(0, start - WARMUP_FRAMES) if resumed else 0):
        if frame.index < start:
            detector(frame.image)  # warm-up of the background model only
            continue
        if deadline is not None and time.monotonic() > deadline:
            break
        _process(frame, detector, tracker, teacher, rule, store, buffers, first_frame, resumed)
        for number in tracker.finished():
            _finish(number, buffers, first_frame, frame.index + 1, tracker, rule, store, progress)
        progress.frames = frame.index + 1
        if not buffers and frame.index % 50 == 0:
            store.set(frame_next=frame.index + 1)
        if on_frame is not None:
            on_frame(progress)
    else:
        for number in tracker.finished(flush=True):
            _finish(number, buffers, first_frame, len(source), tracker, rule, store, progress)
        store.set(frame_next=max(progress.frames, len(source)), capture_done=1)
        progress.finished = True
    progress.seconds = time.monotonic() - began
    return progress


def _process(
    frame: Frame,
    detector: Detector,
    tracker: Tracker,
    teacher: Teacher,
    rule: LabelRule,
    store: Store,
    buffers: dict[int, list[Crop]],
    first_frame: dict[int, int],
    resumed: bool,
) -> None:
    boxes = detector(frame.image)
    if resumed and boxes:
        seen = store.seen_boxes(frame.index)
        boxes = [b for b in boxes if all(iou(b.as_tuple(), s) < 0.5 for s in seen)]
    tracked = tracker.update(frame.index, boxes)
    if not tracked:
        return
    height, width = frame.image.shape[:2]
    crops = [square_crop(frame.image, t.box.as_tuple(), CROP) for t in tracked]
    small = [cv2.resize(c, (INPUT, INPUT), interpolation=cv2.INTER_AREA) for c in crops]
    labels, confidences = teacher.predict(small)
    for t, crop, label, conf in zip(tracked, crops, labels, confidences, strict=True):
        truth_label, angle = -1, None
        best = 0.5
        for truth in frame.truth:
            overlap = iou(t.box.as_tuple(), truth.box)
            if overlap >= best:
                best, truth_label, angle = overlap, truth.label, truth.angle_deg
        vote = bool(conf >= rule.threshold) and not t.box.touches_border(width, height)
        buffers.setdefault(t.track, []).append(
            Crop(
                frame.index,
                frame.seconds,
                t.box.as_tuple(),
                crop,
                float(conf),
                int(label),
                vote,
                truth_label,
                angle,
            )
        )
        first_frame.setdefault(t.track, frame.index)


def _finish(
    number: int,
    buffers: dict[int, list[Crop]],
    first_frame: dict[int, int],
    next_frame: int,
    tracker: Tracker,
    rule: LabelRule,
    store: Store,
    progress: CaptureProgress,
) -> None:
    crops = buffers.pop(number, [])
    first_frame.pop(number, None)
    votes = [(c.teacher_label, c.confidence) for c in crops if c.vote]
    label = rule.decide(votes) if crops else None
    progress.tracks += 1
    if label is None:
        progress.dropped_tracks += 1
    else:
        progress.labelled_tracks += 1
    resume_at = min([next_frame, *first_frame.values()])
    written = store.add_track(
        number,
        crops,
        label,
        {
            "frame_next": resume_at,
            "next_track": tracker.next_id,
            "tracks": progress.tracks,
            "labelled_tracks": progress.labelled_tracks,
            "dropped_tracks": progress.dropped_tracks,
        },
    )
    progress.images = store.count() if store.cap_bytes is not None else progress.images + written


def teacher_view(crop: np.ndarray) -> np.ndarray:
    """A stored 224 x 224 crop as the classifiers see it (INPUT x INPUT)."""
    return cv2.resize(crop, (INPUT, INPUT), interpolation=cv2.INTER_AREA)
