"""The device model: timed once per machine, cached and verified, and sized chains exact."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

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
    data["values"]["seconds_per_op"] *= 2  # the checksum no longer matches
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


def test_grouped_convolutions_and_backwards_are_timed_on_their_own_points() -> None:
    slow = [[1e3, 1e-2], [1e12, 1e7]]  # far slower per FLOP than SPEED's dense convolutions
    speed = ds.DeviceSpeed.from_dict(
        {**SPEED, "depthwise_flops": slow, "depthwise_backward_flops": [[1e3, 1.0], [1e12, 1e9]]}
    )

    def seconds(groups: int, backward: bool) -> float:
        x = torch.empty(2, 8, 16, 16, device="meta", requires_grad=backward)
        w = torch.empty(8, 8 // groups, 3, 3, device="meta", requires_grad=backward)
        mode = ds.OpSeconds(speed)
        out = torch.conv2d(x, w, padding=1, groups=groups)
        with mode:
            if backward:
                torch.autograd.grad(out, (x, w), torch.ones_like(out))
            else:
                torch.conv2d(x, w, padding=1, groups=groups)
        return mode.seconds

    dense, depthwise = seconds(1, False), seconds(8, False)
    assert depthwise > dense  # 8 times fewer FLOPs, on points far slower per FLOP
    assert seconds(8, True) > 50 * seconds(8, False)  # its backward on its own points
    without = ds.DeviceSpeed.from_dict(SPEED)  # none measured: a grouped one as a dense one
    mode = ds.OpSeconds(without)
    x, w = torch.empty(2, 8, 16, 16, device="meta"), torch.empty(8, 1, 3, 3, device="meta")
    with mode:
        torch.conv2d(x, w, padding=1, groups=8)
    assert mode.seconds < depthwise


def test_the_measured_points_count_work_as_the_flop_counter_does() -> None:
    forward, backward = ds._convolutions(groups=True)
    channels, side = ds.CONVOLUTIONS[0]
    x = torch.randn(4, channels, side, side, requires_grad=True)
    w = torch.randn(channels, 1, 3, 3, requires_grad=True)
    out = torch.conv2d(x, w, padding=1, groups=channels)
    with FlopCounterMode(display=False) as counter:
        torch.autograd.grad(out, (x, w), torch.ones_like(out))
    assert backward[0][0] == counter.get_total_flops()
    assert forward[0][0] == 2 * 4 * channels * side * side * 9
