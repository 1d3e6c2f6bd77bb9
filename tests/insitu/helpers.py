"""Small in-situ stores and subprocess entry points for the in-situ tests.

Run as ``python -m tests.insitu.helpers train STORE`` / ``write STORE N`` from the repository root:
the kill -9 tests start these and kill them at random moments.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from edgetrain.insitu.network import classifier
from edgetrain.insitu.store import Crop, Store
from edgetrain.insitu.student import TrainConfig, train_student

CLASSES = 3


def crops(track: int, n: int, label: int, seed: int = 0) -> list[Crop]:
    """``n`` 224 x 224 crops of a coloured blob whose shape depends on ``label``."""
    rng = np.random.default_rng([seed, track])
    out = []
    for k in range(n):
        image = np.full((224, 224, 3), rng.integers(40, 200, 3), np.uint8)
        size = 40 + 20 * label + int(rng.integers(0, 10))
        image[112 - size : 112 + size, 112 - size // 2 : 112 + size // 2] = rng.integers(0, 255, 3)
        image = np.clip(image + rng.normal(0, 4, image.shape), 0, 255).astype(np.uint8)
        out.append(
            Crop(track * 100 + k, k / 25, (0, 0, 10, 10), image, 0.95, label, k == 0, label, 0.0)
        )
    return out


def fill(directory: Path, tracks: int, per_track: int = 12, start: int = 0) -> None:
    """Add ``tracks`` labelled tracks to the store at ``directory``."""
    store, _ = Store.open(directory)
    with store:
        for t in range(start, start + tracks):
            store.add_track(t, crops(t, per_track, t % CLASSES), t % CLASSES, {"tracks": t + 1})


def teacher_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return classifier(CLASSES).state_dict()


TEST_CONFIG = TrainConfig(
    memory_bytes=512 * 1024**2,
    max_batch=8,
    epochs=4,
    checkpoint_every=2,
    threads=1,
    idle_threshold=1.0,
    low_priority=False,
)


def train(directory: Path) -> None:
    store, _ = Store.open(directory, create=False)
    with store:
        result = train_student(store, CLASSES, teacher_state(), TEST_CONFIG)
    print(f"done {result.step} {result.resumed_from}", flush=True)


if __name__ == "__main__":
    command, where = sys.argv[1], Path(sys.argv[2])
    if command == "train":
        train(where)
    elif command == "write":
        fill(where, int(sys.argv[3]), start=int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    else:
        raise SystemExit(f"unknown command {command}")
