"""Shared helpers: random chains for property tests, small models for executor tests."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from hypothesis import strategies as st
from torch import nn

from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.core.chain import Chain, Stage
from edgetrain.devices.energy import EnergyProfile

# The executor's costs per stage operation and per unit and stage rebuilt inside a graph run
# (measured once per machine: about 60 us and a few hundred us here) make the suite's small models
# store everything under max_recompute: they exist to exercise plans that recompute, so the suite
# plans with those costs at 0 unless a test sets them
# (tests/runtime/test_time_includes_stage_cost.py does).
os.environ.setdefault("EDGETRAIN_STAGE_SECONDS", "0")
os.environ.setdefault("EDGETRAIN_REBUILD_SECONDS", "0")
os.environ.setdefault("EDGETRAIN_REBUILT_STAGE_SECONDS", "0")

# Modelled stage times come from this machine's speed, timed once and cached; the suite uses one
# fixed speed instead (10 GFLOP/s, 5 GB/s, 5 us a call), so its plans are the same on every
# machine and no test writes the user's cache.
os.environ.setdefault(
    "EDGETRAIN_DEVICE_SPEED",
    json.dumps(
        {
            "matmul_flops": [[1e6, 1e-4], [1e12, 100.0]],
            "conv_flops": [[1e6, 1e-4], [1e12, 100.0]],
            "elementwise_bytes": [[1e3, 2e-7], [1e12, 200.0]],
            "seconds_per_op": 5e-6,
        }
    ),
)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # scripts/test runs two workers on two cores: one torch thread each (tests that compare two
    # runs make both in the same process, with the same thread count).
    torch.set_num_threads(1)

# The files whose tests take longest (CPU seconds, measured), heaviest first. pytest-xdist hands
# tests to its two workers in collection order as each worker frees up, so a long test collected
# near the end keeps one worker busy while the other idles; run first, the long ones leave only
# short tests for the end. Each file's tests stay together and in their order (module fixtures
# are made once per worker), the rest of the suite follows in its usual order.
HEAVY_FIRST = (
    "tests/models/zoo/test_zoo_exact.py",
    "tests/runtime/test_any_model.py",
    "tests/tiles/test_graph_exact.py",
    "tests/tiles/test_exact.py",
    "tests/tiles/test_cli.py",
    "tests/insitu/test_cli.py",
    "tests/runtime/test_hugging_face.py",
    "tests/tiles/test_recovery.py",
    "tests/tiles/test_survivors.py",
    "tests/insitu/test_student.py",
    "tests/tiles/test_budget.py",
    "tests/runtime/test_paging_shared_and_full.py",
    "tests/insitu/test_run_bounded.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: index for index, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


# 1 flop/s and 1 flop/J, paging no cheaper than that: a node's joules equal its seconds, so
# least energy is least time (the MILP and POET-schedule tests compare against the chain DP).
UNIT = EnergyProfile(
    name="unit",
    title="one joule per second",
    flops_per_second=1.0,
    flops_per_joule=1.0,
    pagein_latency_seconds=0.0,
    pagein_bytes_per_second=1.0,
    pageout_latency_seconds=0.0,
    pageout_bytes_per_second=1.0,
    memory_watts=1.0,
    compute_watts=1.0,
)


def random_chain(rng: random.Random, length: int, *, scale: int = 10) -> Chain:
    """A heterogeneous chain with integer sizes and times, every field varied."""
    stages = []
    for i in range(length):
        out = rng.randint(1, scale)
        saved = rng.randint(0, scale)
        weights = rng.randint(0, scale // 2)
        stages.append(
            Stage(
                name=f"s{i}",
                output_bytes=out,
                saved_bytes=saved,
                saves_input=rng.random() < 0.7,
                saves_output=rng.random() < 0.4,
                forward_peak_bytes=out + rng.randint(0, scale // 2),
                forward_grad_peak_bytes=out + saved + rng.randint(0, scale // 2),
                backward_peak_bytes=rng.randint(1, scale + 2),
                weight_bytes=weights,
                gradient_bytes=weights if rng.random() < 0.5 else 0,
                forward_seconds=rng.uniform(0.5, 2.0),
                backward_seconds=rng.uniform(0.5, 3.0),
            )
        )
    return Chain(
        tuple(stages), input_bytes=rng.randint(1, scale), input_requires_grad=rng.random() < 0.5
    )


def every_kind_chain(rng: random.Random, length: int, *, scale: int = 10) -> Chain:
    """A chain with every kind of stage the planners see: outputs of one tensor or two (the
    graph saving all, one or none of them), inputs saved or not, a parameter tied to an earlier
    stage's (its gradient summed before it is added), a backward peaking otherwise when
    gradients are kept, leading stages without a gradient, tensors carried through unchanged."""
    stages: list[Stage] = []
    two_in = False  # whether the last output has two tensors
    needs_grad = rng.random() < 0.5
    for i in range(length):
        out = rng.randint(1, scale)
        saved = rng.randint(0, scale)
        weights = rng.randint(0, scale // 2)
        grads = weights if rng.random() < 0.6 else 0
        needs_grad = needs_grad or grads > 0
        two_out = rng.random() < 0.4
        leaves = (out, rng.randint(1, scale)) if two_out else ()
        carried: tuple[tuple[int, int], ...] = ()
        if two_out and two_in and rng.random() < 0.5:
            previous = stages[-1].leaf_bytes[1]  # the skip, passed on unchanged
            leaves = (out, previous)
            carried = ((1, 1),)
        save_output = rng.choice(("all", "one", "none"))
        stages.append(
            Stage(
                name=f"s{i}",
                output_bytes=sum(leaves) if leaves else out,
                saved_bytes=saved,
                saves_input=rng.random() < 0.5,
                saves_output=save_output != "none",
                saved_outputs=(0,) if two_out and save_output == "one" else None,
                leaf_bytes=leaves,
                carried=carried,
                forward_peak_bytes=out + rng.randint(0, scale // 2),
                forward_grad_peak_bytes=out + saved + rng.randint(0, scale // 2),
                backward_peak_bytes=rng.randint(1, scale + 2),
                backward_peak_kept_bytes=(
                    rng.randint(1, scale + 2) if rng.random() < 0.3 else None
                ),
                weight_bytes=weights,
                gradient_bytes=grads,
                shared_gradient_bytes=grads if grads and rng.random() < 0.3 else 0,
                output_requires_grad=needs_grad,
                forward_seconds=rng.uniform(0.5, 2.0),
                backward_seconds=rng.uniform(0.5, 3.0),
            )
        )
        two_in = two_out
    return Chain(tuple(stages), input_bytes=rng.randint(1, scale), input_requires_grad=False)


@st.composite
def every_kind_chains(draw: st.DrawFn, min_length: int = 1, max_length: int = 8) -> Chain:
    """Hypothesis strategy for :func:`every_kind_chain`."""
    seed = draw(st.integers(0, 2**32 - 1))
    length = draw(st.integers(min_length, max_length))
    return every_kind_chain(random.Random(seed), length)


def output_saving_chain(rng: random.Random, length: int, *, saves_input: bool) -> Chain:
    """A chain whose stages keep their output (and their input, with ``saves_input``), sizes in
    multiples of 4 bytes and integer times: small MILP instances with proven optima."""
    stages = []
    for k in range(length):
        size = rng.randint(1, 6) * 4
        before = 8 if k == 0 else stages[-1].output_bytes
        stages.append(
            Stage(
                name=f"s{k}",
                output_bytes=size,
                saved_bytes=0,
                saves_input=saves_input,
                saves_output=True,
                forward_peak_bytes=size,
                forward_grad_peak_bytes=size,
                backward_peak_bytes=before if k > 0 else 0,
                weight_bytes=0,
                gradient_bytes=0,
                forward_seconds=float(rng.randint(1, 4)),
                backward_seconds=float(rng.randint(1, 4)),
            )
        )
    return Chain(tuple(stages), input_bytes=8)


def loss_and_peak(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One step of a mean-square loss: the loss, and the peak of live tensor storages (bytes)."""
    counter = StorageCounter()
    with counter:
        loss = net(x).square().mean()
        loss.backward()
    return loss.detach(), counter.peak_bytes


@st.composite
def chains(draw: st.DrawFn, min_length: int = 1, max_length: int = 8) -> Chain:
    """Hypothesis strategy for random chains."""
    seed = draw(st.integers(0, 2**32 - 1))
    length = draw(st.integers(min_length, max_length))
    return random_chain(random.Random(seed), length)


class Scale(nn.Module):
    """A stage with a parameter and no buffers: y = x * w (keeps its input for backward)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def small_cnn(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """Conv/BN/in-place ReLU/dropout/max-pool/flatten/linear: every kind of stage the executor
    must handle (in-place and view children get merged into stages)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Dropout(0.25),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.Dropout(0.5),
        nn.ReLU(),
        Scale(16),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    ).to(dtype)


@pytest.fixture
def cnn() -> nn.Sequential:
    return small_cnn()
