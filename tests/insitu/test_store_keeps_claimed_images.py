"""At open, an image is deleted only when no row claims it by name or by hash; a row whose
``file`` is damaged gets its image's name back from its ``sha256``."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from edgetrain.insitu.store import Store
from tests.insitu.helpers import fill


def _damage_file(directory: Path, row_id: int, new: str) -> None:
    db = sqlite3.connect(directory / "store.sqlite")
    db.execute("UPDATE images SET file = ? WHERE id = ?", (new, row_id))
    db.commit()
    db.close()


def test_a_row_whose_file_lost_one_character_keeps_its_image_and_is_repaired(tmp_path):
    fill(tmp_path, 2, per_track=4)
    store, _ = Store.open(tmp_path)
    with store:
        rows, _ = store.rows()
        victim = rows[5]
    damaged = ("0" if victim.file[0] != "0" else "1") + victim.file[1:]
    _damage_file(tmp_path, victim.id, damaged)
    image = (tmp_path / "images" / victim.file).read_bytes()

    store, report = Store.open(tmp_path)
    with store:
        assert (report.orphans_removed, report.rows_repaired) == (0, 1)
        assert (tmp_path / "images" / victim.file).read_bytes() == image
        rows, problems = store.rows()
        assert problems == []
        repaired = next(r for r in rows if r.id == victim.id)
        assert repaired.file == victim.file
        for row in rows:
            store.read(row)  # every image verifies against its hash
    store, again = Store.open(tmp_path)
    store.close()
    assert again.rows_repaired == 0  # repaired once, for good


def test_an_image_a_damaged_row_still_claims_by_hash_is_kept_when_the_name_is_taken(tmp_path):
    fill(tmp_path, 1, per_track=3)
    store, _ = Store.open(tmp_path)
    with store:
        first, second, _ = store.rows()[0]
    _damage_file(tmp_path, first.id, "garbage")
    # the damaged row's name now belongs to another row: no repair, but no deletion either
    _damage_file(tmp_path, second.id, first.file)
    store, report = Store.open(tmp_path)
    store.close()
    assert report.orphans_removed == 0
    assert (tmp_path / "images" / first.file).exists()
    assert (tmp_path / "images" / second.file).exists()


def test_an_image_no_row_claims_is_still_removed(tmp_path):
    fill(tmp_path, 1, per_track=2)
    (tmp_path / "images" / "0123456789abcdef0123.webp").write_bytes(b"x")
    store, report = Store.open(tmp_path)
    store.close()
    assert (report.orphans_removed, report.rows_repaired) == (1, 0)
    assert not (tmp_path / "images" / "0123456789abcdef0123.webp").exists()
