"""The teacher: a CNN trained once on canonical views, and the rule that labels whole tracks.

The teacher stands for a generic model trained elsewhere: it has seen every class only frontal
and centred (:func:`canonical_views`), never from this camera's angles. It is trained once, on
first use, and cached in the user's cache directory (``$EDGETRAIN_CACHE_DIR``, else
``$XDG_CACHE_HOME/edgetrain``, else ``~/.cache/edgetrain``) as a checksummed file loaded with
``weights_only=True``; a cache file that fails its check is retrained and rewritten.

Labelling (:class:`LabelRule`): the teacher's votes on a track are the frames where the object is
wholly in view and its top probability reaches ``threshold``. A track gets a label when it has at
least ``min_votes`` votes and one class holds at least ``agreement`` of them; the label then goes
to every frame of the track. Any other track (too few confident frames, or conflicting confident
labels) is dropped whole: a wrong label costs more than a missing one.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
from torch import nn

from edgetrain.cache import cache_dir
from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.insitu.detect import square_crop
from edgetrain.insitu.files import load_state, save_state
from edgetrain.insitu.network import INPUT, classifier, to_input
from edgetrain.insitu.scene import view

TEACHER_VERSION = 1


def canonical_views(classes: int, per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Frontal, centred views of each class on generic backgrounds: uint8 crops and labels."""
    rng = np.random.default_rng([seed, 55])
    crops, labels = [], []
    for i in range(classes * per_class):
        label = i % classes
        hsv = np.uint8([[[rng.integers(0, 180), rng.integers(110, 230), rng.integers(160, 255)]]])
        color = tuple(int(v) for v in cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0, 0])
        size = float(rng.uniform(32, 50))
        image, alpha = view(label, (color[0], color[1], color[2]), 0.0, 0.5, size)
        side = image.shape[0]
        small = rng.uniform(50, 190, (3, 3, 3)).astype(np.float32)
        back = cv2.resize(small, (side, side), interpolation=cv2.INTER_CUBIC)
        canvas = back * (1 - alpha[..., None]) + image * alpha[..., None]
        canvas += rng.normal(0, 3, canvas.shape)
        ys, xs = np.nonzero(alpha > 0.5)
        jitter = rng.integers(-2, 3, 4)
        box = (
            int(xs.min() + jitter[0]),
            int(ys.min() + jitter[1]),
            int(xs.max() + 1 + jitter[2]),
            int(ys.max() + 1 + jitter[3]),
        )
        crops.append(square_crop(np.clip(canvas, 0, 255).astype(np.uint8), box, INPUT))
        labels.append(label)
    return np.stack(crops), np.array(labels)


def train_teacher(
    classes: int, seed: int = 0, *, per_class: int = 400, epochs: int = 6
) -> nn.Sequential:
    """Train the teacher on canonical views only (about 20-30 s on one core by default)."""
    torch.manual_seed(seed)
    model = classifier(classes)
    crops, labels = canonical_views(classes, per_class, seed)
    x, y = to_input(crops), torch.from_numpy(labels).long()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), 64):
            idx = order[start : start + 64]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()
    return model


@dataclass(frozen=True)
class Teacher:
    """The cached teacher model and where it came from."""

    model: nn.Sequential
    classes: int
    path: Path
    retrained: bool  # True when the cache was missing or failed its checksum

    def predict(self, crops: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Labels and confidences (top softmax probability) for uint8 crops of side INPUT."""
        if not crops:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        with torch.no_grad():
            probs = torch.softmax(self.model(to_input(crops)), dim=1)
        conf, labels = probs.max(dim=1)
        return labels.numpy(), conf.numpy()


def load_teacher(
    classes: int,
    seed: int = 0,
    directory: Path | None = None,
    *,
    per_class: int = 400,
    epochs: int = 6,
) -> Teacher:
    """The cached teacher for ``classes`` (trained and cached on first use)."""
    name = f"teacher-v{TEACHER_VERSION}-k{classes}-s{seed}-n{per_class}-e{epochs}.pt"
    path = (directory or cache_dir()) / name
    model = classifier(classes)
    if path.exists():
        try:
            state = load_state(path)
            model.load_state_dict(state["model"])
            model.eval()
            return Teacher(model, classes, path, retrained=False)
        except (CorruptFile, KeyError, RuntimeError):
            pass  # a cache: train it again below
    try:  # before the minutes of training, not after
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as exc:
        raise InvalidInput(
            f"cannot write the teacher's cache in {path.parent} ({exc.strerror}); set "
            "EDGETRAIN_CACHE_DIR to a writable directory"
        ) from exc
    model = train_teacher(classes, seed, per_class=per_class, epochs=epochs)
    save_state(path, {"model": model.state_dict(), "classes": classes})
    return Teacher(model, classes, path, retrained=True)


@dataclass(frozen=True)
class LabelRule:
    """When a track's teacher votes become a label for the whole track (see module docstring)."""

    threshold: float = 0.9
    min_votes: int = 2
    agreement: float = 0.8

    def decide(self, votes: list[tuple[int, float]]) -> int | None:
        """The track's label from (label, confidence) votes, or None to drop the track."""
        confident = [label for label, conf in votes if conf >= self.threshold]
        if len(confident) < self.min_votes:
            return None
        label, count = Counter(confident).most_common(1)[0]
        return int(label) if count >= self.agreement * len(confident) else None
