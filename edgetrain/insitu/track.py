"""Multi-object tracking: motpy's Kalman-filter tracker, with each detection given its track.

motpy (``MultiObjectTracker``: constant-velocity Kalman filters matched by IoU) installs with
numpy 2 and needs no OpenCV of its own. The other candidates do not fit this package: ``trackers``
needs the full ``opencv-python`` (a second OpenCV build beside the headless one), ``norfair`` pins
numpy < 2, ``boxmot`` and ``bytetracker`` need CUDA or an old torch.

motpy names tracks by random UUIDs and does not say which detection fed which track; here tracks
are numbered in the order they first appear (reproducible) and each detection goes to the track
whose predicted box overlaps it most (Hungarian assignment on IoU, scipy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from motpy import Detection, MultiObjectTracker
from scipy.optimize import linear_sum_assignment

from edgetrain.insitu.detect import Box, iou


@dataclass(frozen=True)
class Tracked:
    """A detection in one frame and the track it belongs to (tracks are numbered from 0)."""

    track: int
    box: Box


class Tracker:
    """Link detections across frames into tracks. ``finished()`` reports tracks that ended."""

    def __init__(self, fps: float = 25.0, *, max_gap: int = 8, first_id: int = 0) -> None:
        self._tracker = MultiObjectTracker(
            dt=1.0 / fps,
            model_spec="constant_velocity_and_static_box_size_2d",
            tracker_kwargs={"max_staleness": max_gap},
            matching_fn_kwargs={"min_iou": 0.2},
            active_tracks_kwargs={"min_steps_alive": 2, "max_staleness": 2},
        )
        self._ids: dict[str, int] = {}
        self._last_seen: dict[int, int] = {}
        self._next = first_id
        self.max_gap = max_gap
        self.frame = -1

    def update(self, frame: int, boxes: list[Box]) -> list[Tracked]:
        """Feed one frame's detections; the detections that belong to a confirmed track."""
        self.frame = frame
        tracks = self._tracker.step(
            [Detection(box=np.array(b.as_tuple(), dtype=float), score=1.0) for b in boxes]
        )
        if not tracks or not boxes:
            return []
        cost = np.array([[-iou(tuple(t.box), b.as_tuple()) for b in boxes] for t in tracks])
        rows, cols = linear_sum_assignment(cost)
        out: list[Tracked] = []
        for r, c in zip(rows, cols, strict=True):
            if -cost[r, c] < 0.3:
                continue
            key = tracks[r].id
            if key not in self._ids:
                self._ids[key] = self._next
                self._next += 1
            number = self._ids[key]
            self._last_seen[number] = frame
            out.append(Tracked(number, boxes[c]))
        return sorted(out, key=lambda t: t.track)

    def finished(self, *, flush: bool = False) -> list[int]:
        """Tracks not seen for more than ``max_gap`` frames (all tracks with ``flush``)."""
        done = [
            t for t, seen in self._last_seen.items() if flush or self.frame - seen > self.max_gap
        ]
        for t in done:
            del self._last_seen[t]
        return sorted(done)

    @property
    def next_id(self) -> int:
        """The number the next new track will get."""
        return self._next
