"""The in-situ picture reads: words apart, track labels inside the frame, a y-axis scale."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from edgetrain.insitu.evaluate import AngleBin, Report, label_position, picture, write


def _widest_gap(image: Image.Image) -> int:
    """The most blank pixel columns in a row between the first and the last inked column."""
    ink = (np.asarray(image.convert("L")) < 128).any(axis=0)
    columns = np.flatnonzero(ink)
    return int(np.diff(columns).max()) - 1


def test_words_of_a_caption_are_drawn_apart():
    image = Image.new("RGB", (300, 20), "white")
    write(ImageDraw.Draw(image), (2, 2), "by off-axis angle", "black")
    assert _widest_gap(image) >= 4


def test_a_track_label_stays_inside_the_frame():
    frame = (640, 480)
    for box in [(600, 0, 639, 30), (0, 0, 40, 40), (300, 450, 340, 479), (630, 470, 639, 479)]:
        x, y = label_position(box, (60, 11), frame)
        assert x >= 0 and x + 60 < frame[0] and y >= 0 and y + 11 < frame[1], box


def test_the_accuracy_chart_has_a_labelled_y_axis(tmp_path):
    bins = [AngleBin(15 * k, 15 * (k + 1), 10, 0.9, 0.5 + 0.1 * k) for k in range(4)]
    report = Report(0.9, 0.6, 0.9, 0.7, bins, None, None, 0, 0, 0, 0.0, 0, 0, 0, 0)
    path = tmp_path / "p.png"
    picture(report, None, None, path)  # type: ignore[arg-type]
    chart = np.asarray(Image.open(path).convert("L"))[56:, 320 + 2 : 320 + 26]
    rows_with_ink = np.flatnonzero((chart < 128).any(axis=1))
    assert len(rows_with_ink) > 0, "nothing left of the y axis: no scale"
    assert rows_with_ink[-1] - rows_with_ink[0] > chart.shape[0] // 2  # labels from 0 to 100 %
