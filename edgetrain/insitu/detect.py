"""Detection for a fixed camera: background subtraction (OpenCV's MOG2) to boxes, and crops.

A fixed camera sees the same background in every frame, so whatever differs from the learnt
background is a moving object. The foreground mask is cleaned with a morphological opening and
closing; each connected blob of at least ``min_area`` pixels is one box.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

CROP = 224  # side of a stored crop, pixels (the paper's standard resolution)


@dataclass(frozen=True)
class Box:
    """A detected object: (x0, y0, x1, y1) in pixels (x1, y1 exclusive)."""

    x0: int
    y0: int
    x1: int
    y1: int

    @property
    def area(self) -> int:
        return max(0, self.x1 - self.x0) * max(0, self.y1 - self.y0)

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.x0, self.y0, self.x1, self.y1)

    def touches_border(self, width: int, height: int, margin: int = 2) -> bool:
        """True when the box reaches the frame's edge: the object may be only partly in view."""
        return (
            self.x0 <= margin
            or self.y0 <= margin
            or self.x1 >= width - margin
            or self.y1 >= height - margin
        )


def iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """Intersection over union of two (x0, y0, x1, y1) boxes."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


class Detector:
    """Background subtraction to boxes. Call it on consecutive frames of one camera."""

    def __init__(self, *, history: int = 200, min_area: int = 150) -> None:
        self.subtractor = cv2.createBackgroundSubtractorMOG2(
            history=history, varThreshold=24, detectShadows=False
        )
        self.min_area = min_area
        self.kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (5, 5))

    def __call__(self, image: np.ndarray) -> list[Box]:
        mask = self.subtractor.apply(image)
        mask = cv2.morphologyEx(mask, cv2.MORPH_OPEN, self.kernel)
        mask = cv2.morphologyEx(mask, cv2.MORPH_CLOSE, self.kernel, iterations=2)
        count, _labels, stats, _ = cv2.connectedComponentsWithStats(mask)
        boxes = []
        for k in range(1, count):
            x, y, w, h, area = (int(v) for v in stats[k])
            if area >= self.min_area:
                boxes.append(Box(x, y, x + w, y + h))
        return boxes


def square_crop(image: np.ndarray, box: tuple[int, int, int, int], size: int = CROP) -> np.ndarray:
    """A ``size`` x ``size`` crop centred on ``box``, 20 % margin, edges replicated (uint8)."""
    x0, y0, x1, y1 = box
    side = max(x1 - x0, y1 - y0) * 1.2 + 2
    cx, cy = (x0 + x1) / 2.0, (y0 + y1) / 2.0
    half = side / 2.0
    m = np.float32(
        [[size / side, 0, (half - cx) * size / side], [0, size / side, (half - cy) * size / side]]
    )
    return cv2.warpAffine(
        image, m, (size, size), flags=cv2.INTER_AREA, borderMode=cv2.BORDER_REPLICATE
    )
