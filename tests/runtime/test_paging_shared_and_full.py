"""A page directory shared by two processes, holding stale pages, or on a disk that fills and
empties: steps never read another run's page, and paging goes on once there is room again."""

from __future__ import annotations

import copy
import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from edgetrain.core.simulator import simulate
from edgetrain.errors import InvalidInput
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.planners.optimal import minimum_memory, store_all
from edgetrain.runtime import paging
from edgetrain.runtime.checkpointed import Checkpointed
from edgetrain.runtime.paging import PageStore
from tests.runtime.test_paging import _paged, _user_model

ROOT = Path(__file__).resolve().parents[2]

# Two trainings on one page directory: each checks every step's gradients against autograd.
_TRAINING = """
import copy, sys, time
from pathlib import Path
import torch
from edgetrain import plan
from edgetrain.runtime.checkpointed import Checkpointed
from edgetrain.planners.optimal import minimum_memory, store_all
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.core.simulator import simulate
from tests.runtime.test_paging import _paged, _user_model

page_dir, go, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
model = _user_model()
reference = copy.deepcopy(model)
x = torch.randn(256, 48, dtype=torch.float64)
chain = analytic_chain(model, x)
everything = simulate(chain, store_all(chain)).peak_bytes
paged = _paged(chain, plan(chain, "optimal", memory=(everything + minimum_memory(chain)) / 2))
assert simulate(chain, paged).pages_out >= 2
net = Checkpointed(model, x, chain=chain, schedule=paged, page_dir=page_dir)
while not go.exists():
    time.sleep(0.01)
for step in range(steps):
    x = torch.randn(256, 48, dtype=torch.float64)
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward() if m is reference else net(x).square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), f"step {step}: wrong gradient"
print("ok")
"""


def test_two_processes_sharing_a_page_directory_never_collide(tmp_path: Path) -> None:
    pages, go = tmp_path / "pages", tmp_path / "go"
    pages.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EDGETRAIN_PROGRESS": "0"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _TRAINING, str(pages), str(go), "60"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    time.sleep(0.5)
    go.touch()
    results = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, results, strict=True):
        assert run.returncode == 0 and out.strip() == "ok", err[-2000:]
    assert list(pages.iterdir()) == []


def test_stale_pages_in_the_directory_are_neither_read_nor_removed(tmp_path: Path) -> None:
    stale = {
        "edgetrain-page-356a192b7913b04c": b"an older version's page of key 1",
        "edgetrain-page-999999-0123abcd-0": b"a killed process's page",
        ".edgetrain-page-999999-0123abcd-1.tmp": b"its temporary file",
    }
    for name, data in stale.items():
        (tmp_path / name).write_bytes(data)
    value = torch.arange(64.0)
    with PageStore(tmp_path) as store:
        for _ in range(3):
            store.put("1", value)
            assert torch.equal(store.take("1"), value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == stale


def _paging_net(page_dir: Path) -> tuple[Checkpointed, torch.nn.Module, torch.nn.Module]:
    from edgetrain import plan

    model = _user_model()
    reference = copy.deepcopy(model)
    x = torch.randn(512, 48, dtype=torch.float64)
    chain = analytic_chain(model, x)
    everything = simulate(chain, store_all(chain)).peak_bytes
    paged = _paged(chain, plan(chain, "optimal", memory=(everything + minimum_memory(chain)) / 2))
    assert simulate(chain, paged).pages_out >= 1
    net = Checkpointed(model, x, chain=chain, schedule=paged, page_dir=page_dir)
    return net, model, reference


def _step_matches_autograd(net: Checkpointed, model: torch.nn.Module, ref: torch.nn.Module) -> None:
    x = torch.randn(512, 48, dtype=torch.float64)
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    net(x).square().mean().backward()
    ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """While the event is set, every page write finds the disk full (ENOSPC at the write)."""
    full = threading.Event()
    real = paging._write_all

    def write_all(fd: int, tensors: list[torch.Tensor]) -> int:
        if full.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, tensors)

    monkeypatch.setattr(paging, "_write_all", write_all)
    monkeypatch.setenv("EDGETRAIN_PROGRESS", "log")
    yield full


def test_paging_waits_for_room_and_the_step_goes_on(
    tmp_path: Path, full_disk: threading.Event, capsys: pytest.CaptureFixture[str]
) -> None:
    net, model, reference = _paging_net(tmp_path)
    full_disk.set()
    threading.Timer(0.6, full_disk.clear).start()  # the room comes back mid-step
    _step_matches_autograd(net, model, reference)
    err = capsys.readouterr().err
    assert "is full; waiting up to" in err and "room again" in err
    assert list(tmp_path.iterdir()) == []  # the step's pages, and their retries, are gone


def test_a_step_that_found_no_room_fails_in_one_line_and_the_next_one_pages_again(
    tmp_path: Path, full_disk: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(paging, "DISK_FULL_RETRY_SECONDS", 0.2)
    net, model, reference = _paging_net(tmp_path)
    full_disk.set()
    with pytest.raises(InvalidInput, match="no room to write a page") as caught:
        _step_matches_autograd(net, model, reference)
    assert "\n" not in str(caught.value)
    full_disk.clear()  # room again
    for _ in range(3):
        _step_matches_autograd(net, model, reference)


def _mount_tmpfs(directory: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    directory.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        capture_output=True,
    )
    return done.returncode == 0


def _fill(path: Path) -> None:
    """Write ``path`` until its filesystem has no byte left."""
    with open(path, "wb", buffering=0) as handle, pytest.raises(OSError, match="space"):
        while True:
            handle.write(b"\0" * 65536)


def test_a_tmpfs_that_fills_and_empties(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    card = tmp_path / "card"
    if not _mount_tmpfs(card, "2m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    monkeypatch.setenv("EDGETRAIN_PROGRESS", "log")
    try:
        net, model, reference = _paging_net(card)
        filler = card / "filler"
        _fill(filler)
        threading.Timer(0.6, filler.unlink).start()
        _step_matches_autograd(net, model, reference)  # waits for the room, then goes on
        assert "room again" in capsys.readouterr().err
        monkeypatch.setattr(paging, "DISK_FULL_RETRY_SECONDS", 0.2)
        net2, model2, reference2 = _paging_net(card)
        _fill(filler)
        with pytest.raises(InvalidInput, match="no room"):
            _step_matches_autograd(net2, model2, reference2)
        filler.unlink()
        for _ in range(3):
            _step_matches_autograd(net2, model2, reference2)
    finally:
        subprocess.run(["umount", "-l", str(card)], check=False)
