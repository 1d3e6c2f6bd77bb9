"""A tampered store database (rows naming ``../../victim.txt``, absolute paths, symlinks, bad
labels and hashes) never makes the store read or delete a file outside it; such rows are skipped
and counted with their reasons, and a checkpoint that does not load is one line."""

from __future__ import annotations

import io
import os
import sqlite3
from pathlib import Path

import pytest
import torch

from edgetrain.errors import CorruptFile
from edgetrain.insitu.files import load_state, write_checked
from edgetrain.insitu.store import Store, UnreadableImage
from edgetrain.insitu.student import CHECKPOINT, load_student, train_student
from tests.insitu.helpers import CLASSES, TEST_CONFIG, fill, teacher_state


def _tamper(store_dir: Path, sql: str, *args: object) -> None:
    db = sqlite3.connect(store_dir / "store.sqlite")
    with db:
        db.execute(sql, args)
    db.close()


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("a user's file outside the store")
    return victim


@pytest.mark.parametrize("kind", ["relative", "absolute", "dot-dot"])
def test_eviction_never_deletes_a_file_a_tampered_row_names_outside_the_store(
    tmp_path: Path, kind: str
) -> None:
    victim = _victim(tmp_path)
    store_dir = tmp_path / "store"  # its images/../../victim.txt is the victim
    fill(store_dir, 2, per_track=4)
    name = {"relative": "../../victim.txt", "absolute": str(victim), "dot-dot": ".."}[kind]
    # The oldest row of the largest label: the first one the cap evicts.
    _tamper(store_dir, "UPDATE images SET file = ? WHERE id = 1", name)
    store, _ = Store.open(store_dir, cap_bytes=0)
    with store:
        store._evict()
        assert store.count() == 0 and store.evicted == 8
    assert victim.read_text() == "a user's file outside the store"
    assert (store_dir / "images").is_dir()


def test_eviction_never_deletes_what_a_symlink_in_the_store_points_to(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    store_dir = tmp_path / "store"
    fill(store_dir, 1, per_track=3)
    store, _ = Store.open(store_dir)
    with store:
        rows, _ = store.rows()
    link = store_dir / "images" / rows[0].file
    link.unlink()
    link.symlink_to(victim)
    store, _ = Store.open(store_dir, cap_bytes=0)
    with store:
        with pytest.raises(UnreadableImage, match="symlink"):
            store.read(rows[0])
        store._evict()
    assert victim.read_text() == "a user's file outside the store"


def test_an_images_folder_that_is_a_symlink_is_neither_read_nor_emptied(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    fill(store_dir, 1, per_track=3)
    elsewhere = tmp_path / "elsewhere"
    (store_dir / "images").rename(elsewhere)
    (store_dir / "images").symlink_to(elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    store = Store(store_dir, sqlite3.connect(store_dir / "store.sqlite"), 0, -1)
    with store:
        rows, _ = store.rows()
        with pytest.raises(UnreadableImage, match="symlink"):
            store.read(rows[0])
        store._evict()
    assert sorted(p.name for p in elsewhere.iterdir()) == before


def test_a_row_naming_a_file_outside_the_store_is_never_read(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    fill(store_dir, 1, per_track=3)
    store, _ = Store.open(store_dir)
    with store:
        rows, _ = store.rows()
        outside = tmp_path / "outside.webp"
        outside.write_bytes((store.images_dir / rows[0].file).read_bytes())
        store.db.execute("UPDATE images SET file = ? WHERE id = ?", ("../../outside.webp", 1))
        good, skipped = store.rows()
        assert [s.id for s in skipped] == [1] and "not the store's name" in skipped[0].reason
        assert 1 not in {r.id for r in good}
        forged = rows[0].__class__(**{**rows[0].__dict__, "file": "../../outside.webp"})
        with pytest.raises(UnreadableImage, match="not an image name"):
            store.read(forged)


def test_corrupt_rows_are_skipped_and_counted_with_their_reasons(tmp_path: Path) -> None:
    fill(tmp_path, 2, per_track=6)
    _tamper(tmp_path, "UPDATE images SET label = 'abc' WHERE id = 1")
    _tamper(tmp_path, "UPDATE images SET label = -7 WHERE id = 2")
    _tamper(tmp_path, "UPDATE images SET label = 99 WHERE id = 3")
    _tamper(tmp_path, "UPDATE images SET sha256 = 'not a hash' WHERE id = 4")
    _tamper(tmp_path, "UPDATE images SET file = '/etc/passwd' WHERE id = 5")
    _tamper(tmp_path, "UPDATE images SET time = 'soon' WHERE id = 6")
    store, opened = Store.open(tmp_path)
    with store:
        rows, _ = store.rows()
        (store.images_dir / rows[-1].file).write_bytes(b"RIFF....WEBPgarbage")
        result = train_student(store, CLASSES, teacher_state(), TEST_CONFIG)
    # Row 5's file name is restored from its hash when the store opens (its image is there), so
    # it is trained on; a name damaged after the open is skipped (the test above).
    assert opened.rows_repaired == 1
    assert result.images == 6 and result.finished
    assert result.skipped_rows == {
        "image has the wrong size": 1,
        "label is not a whole number": 1,
        "label is out of range": 2,
        "sha256 is not 64 hex digits": 1,
        "time is not a finite number": 1,
    }


def _checkpoint(path: Path, state: object) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_checked(path, buffer.getvalue())


class _Runs:
    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, ("echo never",))


def test_a_checkpoint_that_does_not_load_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "state.ckpt"
    _checkpoint(path, {"model": _Runs()})
    with pytest.raises(CorruptFile) as caught:
        load_state(path)
    message = str(caught.value)
    assert "\n" not in message and "weights_only" in message and "\x1b" not in message


def test_a_checkpoint_of_another_shape_is_one_line(tmp_path: Path) -> None:
    fill(tmp_path, 1, per_track=2)
    wrong = {"model": {"0.weight": torch.zeros(3)}, "step": 1, "total_steps": 2}
    _checkpoint(tmp_path / CHECKPOINT, {**wrong, "optimizer": {}, "rng": 0, "ids": 0, "config": 0})
    with pytest.raises(CorruptFile) as caught:
        load_student(tmp_path, CLASSES)
    assert "\n" not in str(caught.value) and "does not fit the student" in str(caught.value)
    store, _ = Store.open(tmp_path)
    with store, pytest.raises(CorruptFile) as caught:
        train_student(store, CLASSES, teacher_state(), TEST_CONFIG)
    assert "\n" not in str(caught.value)


def test_eviction_never_deletes_another_rows_image(tmp_path: Path) -> None:
    fill(tmp_path, 2, per_track=4)
    db = sqlite3.connect(tmp_path / "store.sqlite")
    with db:  # a tampered schema without UNIQUE(file): row 1 names row 5's image
        db.execute("CREATE TABLE copy AS SELECT * FROM images")
        db.execute("DROP TABLE images")
        db.execute("ALTER TABLE copy RENAME TO images")
        other = db.execute("SELECT file FROM images WHERE id = 5").fetchone()[0]
        db.execute("UPDATE images SET file = ? WHERE id = 1", (other,))
        total = db.execute("SELECT SUM(bytes) FROM images").fetchone()[0]
    db.close()
    store, _ = Store.open(tmp_path, cap_bytes=total - 1)
    with store:
        store._evict()
        assert store.evicted == 1
        (five,) = [r for r in store.rows()[0] if r.id == 5]
        assert store.read(five).shape == (224, 224, 3)
