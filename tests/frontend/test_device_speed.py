"""The device model: timed once per machine, cached and verified, and sized chains exact."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from edgetrain.frontend import device_speed as ds
from edgetrain.frontend.profiling import profile_chain
from tests.conftest import small_cnn

SPEED = {
    "matmul_flops": [[1e6, 1e-4], [1e8, 1e-3], [1e9, 1e-2]],
    "conv_flops": [[1e6, 2e-4], [1e8, 2e-3], [1e9, 2e-2]],
    "elementwise_bytes": [[1e4, 1e-5], [1e6, 1e-4], [1e8, 1e-2]],
    "seconds_per_op": 1e-6,
}


def test_the_measurement_is_cached_and_a_damaged_cache_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGETRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(ds.ENV, raising=False)
    monkeypatch.setattr(ds, "_memo", {})
    first = ds.device_speed()
    path = ds.cache_path()
    assert path.parent == tmp_path
    assert ds._read(path) == first
    data = json.loads(path.read_text())
    data["speed"]["seconds_per_op"] *= 2  # the checksum no longer matches
    path.write_text(json.dumps(data))
    assert ds._read(path) is None
    path.write_text("{not json")
    assert ds._read(path) is None


def test_the_environment_sets_the_speed_and_bad_values_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ds.ENV, json.dumps(SPEED))
    speed = ds.device_speed()
    assert speed.seconds_per_op == 1e-6
    bad = {**SPEED, "conv_flops": [[1e6, -1.0]]}
    monkeypatch.setenv(ds.ENV, json.dumps(bad))
    with pytest.raises(ValueError):
        ds.device_speed()


def test_predicted_seconds_grow_with_the_work() -> None:
    speed = ds.DeviceSpeed.from_dict(SPEED)
    works = [1e3, 1e6, 3e7, 1e8, 5e8, 1e9, 1e11]
    seconds = [ds._interpolated(speed.matmul_flops, w) for w in works]
    assert seconds == sorted(seconds)
    assert math.isclose(ds._interpolated(speed.matmul_flops, 1e8), 1e-3)
    mode = ds.OpSeconds(speed)
    a = torch.empty(64, 64, device="meta")
    with mode:
        a @ a
    assert math.isclose(mode.seconds, 1e-6 + ds._interpolated(speed.matmul_flops, 2 * 64**3))


def test_a_modelled_profile_holds_the_measured_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ds.ENV, json.dumps(SPEED))
    model = small_cnn(torch.float32)
    x = torch.randn(2, 3, 8, 8)
    modelled = profile_chain(model, x, timing="modelled")
    measured = profile_chain(model, x, repeats=1)
    assert modelled.fingerprint() == measured.fingerprint()
    assert modelled.autograd_peak_bytes == measured.autograd_peak_bytes
    assert all(s.forward_seconds > 0 and s.backward_seconds >= 0 for s in modelled.stages)
