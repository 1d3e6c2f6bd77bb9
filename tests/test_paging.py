"""PageStore: pages written in the background come back bit for bit, verified, and are deleted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.paging import PageStore


def test_pages_round_trip_exactly_and_leave_nothing_behind(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = {f"a{k}": torch.randn(3, 5, 7, dtype=torch.float64) for k in range(4)}
    with PageStore(tmp_path) as store:
        for key, tensor in tensors.items():
            store.put(key, tensor)
        store.flush()
        assert len(list(tmp_path.iterdir())) == 4
        for key in reversed(list(tensors)):
            back = store.take(key)
            assert back.dtype == tensors[key].dtype and torch.equal(back, tensors[key])
        assert list(tmp_path.iterdir()) == []
        store.put("left", torch.ones(2))
    assert list(tmp_path.iterdir()) == []  # close() removes pages never taken


def test_a_corrupted_page_is_refused(tmp_path: Path) -> None:
    with PageStore(tmp_path) as store:
        store.put("x", torch.arange(100.0))
        store.flush()
        (page,) = tmp_path.iterdir()
        data = bytearray(page.read_bytes())
        data[-5] ^= 0xFF
        page.write_bytes(bytes(data))
        with pytest.raises(CorruptFile, match="checksum"):
            store.take("x")


def test_a_missing_page_is_refused(tmp_path: Path) -> None:
    with PageStore(tmp_path) as store:
        store.put("x", torch.arange(10.0))
        store.flush()
        for page in tmp_path.iterdir():
            page.unlink()
        with pytest.raises(CorruptFile, match="missing"):
            store.take("x")


def test_a_directory_that_cannot_be_used_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="does not exist"):
        PageStore(tmp_path / "nope")
    if os.geteuid() == 0:
        pytest.skip("root can write to read-only directories")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(InvalidInput, match="cannot write"):
            PageStore(locked)
    finally:
        locked.chmod(0o700)


def test_a_write_that_fails_is_reported_by_the_next_call(tmp_path: Path) -> None:
    store = PageStore(tmp_path)
    store.directory = tmp_path / "vanished"  # every write now fails, as on a removed card
    store.put("x", torch.ones(3))
    with pytest.raises(InvalidInput, match="cannot write a page"):
        store.flush()
    store.close()
