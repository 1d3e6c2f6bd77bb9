"""Calls the device model cannot predict are timed on the CPU once per kind of call, outside
every dispatch mode and the random-number stream."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

import edgetrain.frontend.call_seconds as cs
import edgetrain.frontend.device_speed as ds
from edgetrain.autograd.storage_counter import StorageCounter

aten = torch.ops.aten

SPEED = {
    "matmul_flops": [[1e6, 1e-4], [1e9, 1e-2]],
    "conv_flops": [[1e6, 1e-4], [1e9, 1e-2]],
    "elementwise_bytes": [[1e4, 1e-5], [1e6, 1e-4], [1e8, 1e-2]],
    "seconds_per_op": 1e-6,
}


def _batch_norm_args(device: str) -> tuple[torch.Tensor, ...]:
    x = torch.empty(4, 8, 16, 16, device=device)
    w, b = torch.empty(8, device=device), torch.empty(8, device=device)
    mean, var = torch.zeros(8, device=device), torch.ones(8, device=device)
    return x, w, b, mean, var


@pytest.mark.parametrize(
    ("func", "expected"),
    [
        (aten.native_batch_norm.default, True),
        (aten.max_pool2d_with_indices.default, True),
        (aten.native_dropout.default, True),
        (aten.add.Tensor, False),  # elementwise: the bytes it moves predict it
        (aten.convolution.default, False),  # a FLOP formula predicts it
        (aten.view.default, False),
        (aten.add_.Tensor, False),  # returns its input
    ],
)
def test_which_operators_are_timed(func, expected):
    assert cs.timed(func) is expected


def test_a_kind_of_call_is_timed_once_on_the_cpu_outside_the_modes_and_the_rng(monkeypatch):
    monkeypatch.setattr(cs, "_known", {})
    args = (*_batch_norm_args("meta"), True, 0.1, 1e-5)
    state = torch.random.get_rng_state()
    with StorageCounter() as counter:
        first = cs.call_seconds(aten.native_batch_norm.default, args, {})
        again = cs.call_seconds(aten.native_batch_norm.default, args, {})
        dropped = cs.call_seconds(aten.native_dropout.default, (args[0], 0.5, True), {})
    assert first is not None and first > 0 and dropped is not None
    assert again == first and len(cs._known) == 2
    assert counter.peak_bytes == 0  # the CPU tensors it ran on are outside the counter
    assert torch.equal(torch.random.get_rng_state(), state)


def test_calls_not_on_the_cpu_or_too_large_are_left_to_the_model(monkeypatch):
    monkeypatch.setattr(cs, "_known", {})
    monkeypatch.setattr(cs, "LARGEST_BYTES", 1024)
    args = (*_batch_norm_args("meta"), True, 0.1, 1e-5)
    assert cs.call_seconds(aten.native_batch_norm.default, args, {}) is None
    assert cs.call_seconds(aten.add.Tensor, (args[0], args[0]), {}) is None
    assert not cs._known


def test_the_device_model_takes_a_timed_call_at_its_measured_time(monkeypatch):
    monkeypatch.setattr(cs, "_known", {})
    args = (*_batch_norm_args("meta"), True, 0.1, 1e-5)
    out = aten.native_batch_norm.default(*args)
    modelled = ds.DeviceSpeed.from_dict(SPEED)
    timing = ds.DeviceSpeed.from_dict({**SPEED, "times_calls": True})
    assert not modelled.times_calls and timing.times_calls
    measured = cs.call_seconds(aten.native_batch_norm.default, args, {})
    assert measured is not None
    func = aten.native_batch_norm.default
    assert timing.op_seconds(func, args, {}, out) == max(measured, SPEED["seconds_per_op"])
    assert modelled.op_seconds(func, args, {}, out) != timing.op_seconds(func, args, {}, out)
    # A speed given in the environment keeps its flag through the JSON round trip.
    monkeypatch.setenv(ds.ENV, json.dumps(asdict(timing)))
    assert ds.device_speed().times_calls
