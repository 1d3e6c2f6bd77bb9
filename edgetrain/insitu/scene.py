"""Video sources for the in-situ pipeline: a synthetic fixed-camera scene, and real video.

The synthetic scene is what a fixed camera node sees: a static, textured background and objects
of ``classes`` kinds crossing the frame left to right or right to left, each in its own lane. How
an object looks depends on where it is in this camera's view: away from the optical axis it is
foreshortened and seen in perspective (one side nearer), tilted, smaller or larger with depth, and
lit differently (darker and tinted toward the side it is on); all of this grows with the off-axis
angle. The same renderer at angle 0 gives the *canonical* (frontal, centred) views a generic
teacher is trained on.

Everything is seeded: ``SyntheticScene(seed)`` yields the same frames on every machine, and frame
``n`` can be produced without rendering frames ``0 .. n-1`` (a rerun resumes where it stopped).
Ground truth (:class:`Truth`: class, box, off-axis angle of each object) comes with every frame
for evaluation only; the pipeline's labels come from the teacher and the tracker.

:func:`open_video` reads a real video file (any format OpenCV decodes) or a folder of images.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from edgetrain.errors import InvalidInput

CLASS_NAMES = ("disc", "square", "triangle", "cross", "ring", "bar")
SPRITE = 64  # side of a canonical sprite, pixels
MAX_ANGLE_DEG = 72.0  # off-axis angle at the left and right edges of the frame
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MAX_FRAMES = 10**6
"""Longest synthetic video, in frames: 11 hours at 25 frames per second (its object schedule is
made up front: about 29,000 objects and a few seconds at this length)."""


@dataclass(frozen=True)
class Truth:
    """One object in one frame, as the scene made it: for evaluation only.

    ``box`` is (x0, y0, x1, y1) in pixels, clipped to the frame; ``angle_deg`` is the signed
    horizontal off-axis angle of the object's centre; ``inside`` is True when the whole object is
    in the frame.
    """

    object_id: int
    label: int
    box: tuple[int, int, int, int]
    angle_deg: float
    inside: bool


@dataclass(frozen=True)
class Frame:
    """A video frame (H x W x 3 uint8, BGR as OpenCV uses), its index, time (seconds) and truth."""

    index: int
    seconds: float
    image: np.ndarray
    truth: tuple[Truth, ...] = ()


@dataclass(frozen=True)
class _Object:
    object_id: int
    label: int
    start: int  # frame it enters
    direction: int  # +1 left to right, -1 right to left
    lane_y: float  # centre height, pixels
    speed: float  # pixels per frame
    color: tuple[int, int, int]


def angle_at(x: float, width: int) -> float:
    """The signed off-axis angle (degrees) of a point at column ``x`` of a ``width``-wide frame."""
    return MAX_ANGLE_DEG * (2.0 * x / width - 1.0)


def sprite(label: int, color: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The canonical (frontal) view of a class: a BGR image and its alpha mask (float32 0..1)."""
    s = SPRITE
    mask = np.zeros((s, s), np.uint8)
    detail = np.zeros((s, s), np.uint8)
    c = s // 2
    name = CLASS_NAMES[label]
    if name == "disc":
        cv2.circle(mask, (c, c), 28, 255, -1)
        cv2.circle(detail, (c, c), 9, 255, -1)
    elif name == "square":
        cv2.rectangle(mask, (6, 6), (s - 7, s - 7), 255, -1)
        for y in (16, 30, 44):
            cv2.rectangle(detail, (6, y), (s - 7, y + 5), 255, -1)
    elif name == "triangle":
        pts = np.array([[c, 4], [s - 5, s - 8], [4, s - 8]], np.int32)
        cv2.fillPoly(mask, [pts], 255)
        cv2.line(detail, (c, 20), (c, s - 12), 255, 5)
    elif name == "cross":
        cv2.rectangle(mask, (c - 9, 4), (c + 9, s - 5), 255, -1)
        cv2.rectangle(mask, (4, c - 9), (s - 5, c + 9), 255, -1)
    elif name == "ring":
        cv2.circle(mask, (c, c), 28, 255, -1)
        cv2.circle(mask, (c, c), 15, 0, -1)
    else:  # bar
        cv2.rectangle(mask, (c - 8, 4), (c + 8, s - 5), 255, -1)
        cv2.rectangle(detail, (c - 8, c - 3), (c + 8, c + 3), 255, -1)
    base = np.array(color, np.float32)
    image = np.empty((s, s, 3), np.float32)
    image[:] = base
    image[detail > 0] = base * 0.35
    return image, (mask > 0).astype(np.float32)


def view(
    label: int,
    color: tuple[int, int, int],
    angle_deg: float,
    elevation: float,
    size: float,
) -> tuple[np.ndarray, np.ndarray]:
    """A class as this camera sees it at ``angle_deg`` off axis: BGR float image and alpha,
    on a square canvas of side ``2 * size`` pixels with the object centred.

    ``elevation`` (0..1: top to bottom of the frame) squashes it vertically; ``size`` is the
    object's nominal height in pixels. Angle 0 and elevation 0.5 give the canonical view.
    """
    image, alpha = sprite(label, color)
    t = math.radians(angle_deg)
    strength = abs(angle_deg) / MAX_ANGLE_DEG
    half = size / 2.0
    sx = half * math.cos(t)  # foreshortening
    sy = half * (1.0 - 0.25 * abs(elevation - 0.5))
    near = 1.0 + 0.45 * math.sin(t)  # perspective: the nearer side is taller
    far = 1.0 - 0.45 * math.sin(t)
    corners = np.array([[-sx, -sy * far], [sx, -sy * near], [sx, sy * near], [-sx, sy * far]])
    tilt = math.radians(0.55 * angle_deg)
    rot = np.array([[math.cos(tilt), -math.sin(tilt)], [math.sin(tilt), math.cos(tilt)]])
    canvas = round(2 * size)
    dst = (corners @ rot.T + canvas / 2.0).astype(np.float32)
    src = np.array([[0, 0], [SPRITE, 0], [SPRITE, SPRITE], [0, SPRITE]], np.float32)
    h = cv2.getPerspectiveTransform(src, dst)
    out = cv2.warpPerspective(image, h, (canvas, canvas), flags=cv2.INTER_LINEAR)
    a = cv2.warpPerspective(alpha, h, (canvas, canvas), flags=cv2.INTER_LINEAR)
    # Lighting: darker and tinted toward the side the object is on, shaded across its width.
    gain = 1.0 - 0.5 * strength
    tint = np.array([-45.0, 0.0, 45.0], np.float32) * (angle_deg / MAX_ANGLE_DEG)
    ramp = np.linspace(1.0 - 0.35 * strength, 1.0, canvas, dtype=np.float32)
    if angle_deg > 0:
        ramp = ramp[::-1]
    out = out * gain * ramp[None, :, None] + tint
    return np.clip(out, 0, 255), a


def background(width: int, height: int, seed: int) -> np.ndarray:
    """The node's static scene: smooth shaded ground and a few soft blobs (BGR uint8)."""
    rng = np.random.default_rng([seed, 7])
    small = rng.uniform(60, 170, (6, 8, 3)).astype(np.float32)
    image = cv2.resize(small, (width, height), interpolation=cv2.INTER_CUBIC)
    ys = np.linspace(0.85, 1.1, height, dtype=np.float32)[:, None, None]
    texture = rng.normal(0, 6, (height, width, 1)).astype(np.float32)
    return np.clip(image * ys + texture, 0, 255).astype(np.uint8)


def paste(frame: np.ndarray, image: np.ndarray, alpha: np.ndarray, cx: float, cy: float) -> None:
    """Alpha-blend a centred canvas into ``frame`` (float32 H x W x 3) at centre (cx, cy)."""
    side = image.shape[0]
    x0, y0 = round(cx - side / 2), round(cy - side / 2)
    fx0, fy0 = max(x0, 0), max(y0, 0)
    fx1, fy1 = min(x0 + side, frame.shape[1]), min(y0 + side, frame.shape[0])
    if fx0 >= fx1 or fy0 >= fy1:
        return
    a = alpha[fy0 - y0 : fy1 - y0, fx0 - x0 : fx1 - x0, None]
    patch = image[fy0 - y0 : fy1 - y0, fx0 - x0 : fx1 - x0]
    frame[fy0:fy1, fx0:fx1] = frame[fy0:fy1, fx0:fx1] * (1 - a) + patch * a


_SLOWEST = 3.5
"""Slowest object speed, pixels per frame."""


class SyntheticScene:
    """A seeded fixed-camera video of objects crossing the frame.

    ``stream`` chooses an independent sequence of objects seen by the same camera: stream 0 is the
    node's video, stream 1 the held-out frames evaluation uses.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        frames: int = 1500,
        width: int = 320,
        height: int = 240,
        classes: int = 4,
        fps: float = 25.0,
        stream: int = 0,
    ) -> None:
        if not 2 <= classes <= len(CLASS_NAMES):
            raise InvalidInput(f"classes must be 2..{len(CLASS_NAMES)}, got {classes}")
        if frames < 1:
            raise InvalidInput(f"the scene needs at least one frame, got {frames}")
        if frames > MAX_FRAMES:
            raise InvalidInput(
                f"the synthetic scene has at most {MAX_FRAMES:,} frames, got {frames:,}; give "
                f"--frames {MAX_FRAMES} or fewer"
            )
        self.seed, self.frames, self.width, self.height = seed, frames, width, height
        self.classes, self.fps, self.stream = classes, fps, stream
        self.background = background(width, height, seed)
        # Sensor noise: one of eight fixed noise images per frame (cheaper than drawing anew).
        bank = np.random.default_rng([seed, 999])
        self._noise = bank.normal(0.0, 2.5, (8, height, width, 3)).astype(np.float32)
        self.objects = self._schedule()
        self._starts = [obj.start for obj in self.objects]
        longest = (self.width + 2 * self.size_at(self.height)) / _SLOWEST
        self._longest_frames = math.ceil(longest) + 1

    @property
    def class_names(self) -> tuple[str, ...]:
        return CLASS_NAMES[: self.classes]

    def size_at(self, y: float) -> float:
        """Nominal object height (pixels) at row ``y``: nearer (lower) objects look larger."""
        return 0.16 * self.height * (0.8 + 0.5 * y / self.height)

    def _schedule(self) -> list[_Object]:
        rng = np.random.default_rng([self.seed, 100 + self.stream])
        objects: list[_Object] = []
        busy: list[tuple[int, float, float]] = []  # (last frame, lane y, half height)
        f = 30  # the first second is empty: the background model learns the scene
        while f < self.frames:
            lanes = np.linspace(0.26 * self.height, 0.84 * self.height, 5)
            busy = [entry for entry in busy if entry[0] >= f]  # ended lanes stay free
            free = [
                y
                for y in lanes
                if all(end < f or abs(y - by) > bh + self.size_at(y) * 0.6 for end, by, bh in busy)
            ]
            if free:
                y = float(rng.choice(free)) + float(rng.uniform(-4, 4))
                speed = float(rng.uniform(_SLOWEST, 5.5))
                size = self.size_at(y)
                duration = int((self.width + 2 * size) / speed) + 2
                hue = int(rng.integers(0, 180))
                hsv = np.uint8([[[hue, int(rng.integers(120, 220)), int(rng.integers(170, 250))]]])
                color = tuple(int(v) for v in cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0, 0])
                objects.append(
                    _Object(
                        object_id=len(objects),
                        label=int(rng.integers(0, self.classes)),
                        start=f,
                        direction=1 if rng.random() < 0.5 else -1,
                        lane_y=y,
                        speed=speed,
                        color=(color[0], color[1], color[2]),
                    )
                )
                busy.append((f + duration, y, size * 0.6))
            f += int(rng.integers(6, 16))
        return objects

    def _position(self, obj: _Object, index: int) -> tuple[float, float, float] | None:
        size = self.size_at(obj.lane_y)
        travel = (index - obj.start) * obj.speed
        if travel < 0 or travel > self.width + 2 * size:
            return None
        x = -size + travel if obj.direction > 0 else self.width + size - travel
        return x, obj.lane_y, size

    def frame(self, index: int) -> Frame:
        """Frame ``index`` (0-based), rendered on its own (no earlier frame is needed)."""
        canvas = self.background.astype(np.float32)
        truths: list[Truth] = []
        # only objects that entered within the longest crossing can be in view
        first = bisect.bisect_left(self._starts, index - self._longest_frames)
        last = bisect.bisect_right(self._starts, index)
        for obj in self.objects[first:last]:
            where = self._position(obj, index)
            if where is None:
                continue
            x, y, size = where
            angle = angle_at(x, self.width)
            image, alpha = view(obj.label, obj.color, angle, y / self.height, size)
            paste(canvas, image, alpha, x, y)
            ys, xs = np.nonzero(alpha > 0.5)
            if xs.size == 0:
                continue
            side = image.shape[0]
            box = (
                int(x - side / 2 + xs.min()),
                int(y - side / 2 + ys.min()),
                int(x - side / 2 + xs.max()) + 1,
                int(y - side / 2 + ys.max()) + 1,
            )
            clipped = (
                max(box[0], 0),
                max(box[1], 0),
                min(box[2], self.width),
                min(box[3], self.height),
            )
            if clipped[0] >= clipped[2] or clipped[1] >= clipped[3]:
                continue
            truths.append(Truth(obj.object_id, obj.label, clipped, angle, clipped == box))
        pick = int(np.random.default_rng([self.seed, 1000 + self.stream, index]).integers(8))
        canvas += self._noise[pick]
        image = np.clip(canvas, 0, 255).astype(np.uint8)
        return Frame(index, index / self.fps, image, tuple(truths))

    def __iter__(self) -> Iterator[Frame]:
        return self.read(0)

    def read(self, start: int = 0) -> Iterator[Frame]:
        """Frames ``start`` .. the end."""
        for index in range(start, self.frames):
            yield self.frame(index)

    def __len__(self) -> int:
        return self.frames


class VideoSource:
    """A real video file, or a folder of images read in name order, as :class:`Frame` s."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise InvalidInput(f"video {self.path} does not exist; give a video file or a folder")
        self.fps = 25.0
        if self.path.is_dir():
            self.files = sorted(
                p for p in self.path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES
            )
            if not self.files:
                raise InvalidInput(
                    f"folder {self.path} has no images ({', '.join(IMAGE_SUFFIXES)}); "
                    "give a folder of frames or a video file"
                )
            first = cv2.imread(str(self.files[0]), cv2.IMREAD_COLOR)
            if first is None:
                raise InvalidInput(f"cannot read image {self.files[0]}; is it a valid image?")
            self.frames = len(self.files)
        else:
            self.files = []
            capture = cv2.VideoCapture(str(self.path))
            ok, first = capture.read() if capture.isOpened() else (False, None)
            if not ok or first is None:
                capture.release()
                raise InvalidInput(
                    f"cannot read video {self.path}: OpenCV decodes no frame from it; "
                    "give a video file OpenCV can read (e.g. MP4/AVI) or a folder of images"
                )
            fps = capture.get(cv2.CAP_PROP_FPS)
            self.fps = float(fps) if fps and fps > 0 else 25.0
            count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
            self.frames = count if count > 0 else 0
            capture.release()
        self.height, self.width = first.shape[:2]

    def read(self, start: int = 0) -> Iterator[Frame]:
        """Frames from ``start`` on (an undecodable frame ends a file, is skipped in a folder)."""
        if self.files:
            for index, path in enumerate(self.files[start:], start):
                image = cv2.imread(str(path), cv2.IMREAD_COLOR)
                if image is not None and image.shape[:2] == (self.height, self.width):
                    yield Frame(index, index / self.fps, image)
            return
        capture = cv2.VideoCapture(str(self.path))
        try:
            index = 0
            while True:
                ok, image = capture.read()
                if not ok:
                    return
                if index >= start:
                    yield Frame(index, index / self.fps, image)
                index += 1
        finally:
            capture.release()

    def __len__(self) -> int:
        return self.frames


def open_video(path: str | Path) -> VideoSource:
    """A :class:`VideoSource` for a video file or a folder of images; one line if unreadable."""
    return VideoSource(path)
