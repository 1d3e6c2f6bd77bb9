"""Synthetic camera scenes, video reading, detection and tracking."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pytest

from edgetrain.errors import InvalidInput
from edgetrain.insitu.detect import Detector, iou, square_crop
from edgetrain.insitu.scene import MAX_ANGLE_DEG, SyntheticScene, open_video, view
from edgetrain.insitu.teacher import LabelRule
from edgetrain.insitu.track import Tracker


def test_a_seeded_scene_is_reproducible_and_frames_render_alone() -> None:
    a = SyntheticScene(5, frames=120)
    b = SyntheticScene(5, frames=120)
    in_order = list(a.read(0))
    assert np.array_equal(in_order[90].image, b.frame(90).image)
    assert in_order[90].truth == b.frame(90).truth
    assert not np.array_equal(SyntheticScene(6, frames=120).frame(90).image, in_order[90].image)


def test_held_out_stream_has_other_objects_on_the_same_background() -> None:
    node = SyntheticScene(1, frames=300)
    held = SyntheticScene(1, frames=300, stream=1)
    assert np.array_equal(node.background, held.background)
    assert [o.label for o in node.objects] != [o.label for o in held.objects]


def test_appearance_departs_from_the_canonical_view_more_the_further_off_axis() -> None:
    canonical = view(1, (200, 100, 50), 0.0, 0.5, 40.0)[1] > 0.5
    overlap = []
    for angle in (0.0, 20.0, 40.0, 60.0, MAX_ANGLE_DEG):
        mask = view(1, (200, 100, 50), angle, 0.5, 40.0)[1] > 0.5
        overlap.append((canonical & mask).sum() / (canonical | mask).sum())
    assert overlap[0] == 1.0
    assert all(later < earlier for earlier, later in itertools.pairwise(overlap))


def test_background_subtraction_and_tracking_follow_each_object_as_one_track() -> None:
    scene = SyntheticScene(2, frames=260)
    detector, tracker = Detector(), Tracker(scene.fps)
    pairs: list[tuple[int, int]] = []  # (track, object)
    matched = total = 0
    for frame in scene:
        tracked = tracker.update(frame.index, detector(frame.image))
        for t in tracked:
            total += 1
            best = max(frame.truth, key=lambda g: iou(t.box.as_tuple(), g.box), default=None)
            if best is not None and iou(t.box.as_tuple(), best.box) >= 0.5:
                matched += 1
                pairs.append((t.track, best.object_id))
    assert total > 200 and matched / total > 0.95
    by_track = Counter(pairs)
    tracks = {t for t, _ in pairs}
    purity = sum(max(n for (t2, _), n in by_track.items() if t2 == t) for t in tracks)
    assert purity / len(pairs) > 0.97  # a track follows one object


def test_crops_are_square_224_pixels() -> None:
    image = np.zeros((240, 320, 3), np.uint8)
    assert square_crop(image, (300, 10, 320, 80)).shape == (224, 224, 3)


def test_a_folder_of_frames_is_read_in_name_order(tmp_path: Path) -> None:
    scene = SyntheticScene(0, frames=5)
    for k in range(5):
        cv2.imwrite(str(tmp_path / f"f{k:03d}.png"), scene.frame(k).image)
    video = open_video(tmp_path)
    frames = list(video.read(2))
    assert [f.index for f in frames] == [2, 3, 4] and len(video) == 5
    assert np.array_equal(frames[0].image, scene.frame(2).image)


def test_an_unreadable_video_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "clip.mp4"
    bad.write_bytes(b"not a video at all")
    with pytest.raises(InvalidInput, match="cannot read video"):
        open_video(bad)
    with pytest.raises(InvalidInput, match="does not exist"):
        open_video(tmp_path / "missing.mp4")
    with pytest.raises(InvalidInput, match="no images"):
        open_video(tmp_path)


def test_the_label_rule_takes_an_agreeing_majority_and_drops_conflicts() -> None:
    rule = LabelRule(threshold=0.9, min_votes=2, agreement=0.8)
    assert rule.decide([(2, 0.95), (2, 0.99), (1, 0.5)]) == 2
    assert rule.decide([(2, 0.95)]) is None  # one confident frame is not enough
    assert rule.decide([(2, 0.95), (1, 0.97)]) is None  # conflict: dropped whole
    assert rule.decide([(2, 0.95)] * 4 + [(1, 0.97)]) == 2  # 80 % agree
