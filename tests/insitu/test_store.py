"""The in-situ store: small images, checksummed rows, crash-safe writes, eviction, full disk."""

from __future__ import annotations

import random
import resource
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgetrain.errors import CorruptFile
from edgetrain.insitu.files import DiskFull
from edgetrain.insitu.store import Store, StoreError
from tests.insitu.helpers import crops, fill

ROOT = Path(__file__).resolve().parents[2]


def _verify_all(directory: Path) -> int:
    """Open the store, read every row's image (raises on any corrupt one); no unindexed files."""
    store, _ = Store.open(directory)
    with store:
        rows, problems = store.rows()
        assert problems == []
        for row in rows:
            store.read(row)
        files = {p.name for p in store.images_dir.iterdir()}
        assert files == {r.file for r in rows}
        return len(rows)


def test_stored_crops_are_224_webp_under_10kb_and_read_back_verified(tmp_path: Path) -> None:
    fill(tmp_path, 3, per_track=10)
    store, _ = Store.open(tmp_path)
    with store:
        rows, problems = store.rows()
        assert len(rows) == 30 and problems == []
        assert store.total_bytes() / len(rows) <= 10_000
        image = store.read(rows[0])
        assert image.shape == (224, 224, 3)
        assert (store.images_dir / rows[0].file).read_bytes()[8:12] == b"WEBP"
        assert {r.source for r in rows} == {"teacher", "track"}


def test_a_dropped_track_stores_its_crops_but_no_images(tmp_path: Path) -> None:
    store, _ = Store.open(tmp_path)
    with store:
        assert store.add_track(0, crops(0, 5, 1), None, {}) == 0
        assert store.count() == 0
        assert [c[6] for c in store.crops()] == [-1] * 5


def test_a_corrupt_image_is_detected_and_the_rest_still_read(tmp_path: Path) -> None:
    fill(tmp_path, 2, per_track=5)
    store, _ = Store.open(tmp_path)
    with store:
        rows, _ = store.rows()
        (store.images_dir / rows[3].file).write_bytes(b"RIFF....WEBPgarbage")
        store.db.execute("UPDATE images SET label = -5 WHERE id = ?", (rows[7].id,))
        good, problems = store.rows()
        assert len(good) == 9 and len(problems) == 1
        with pytest.raises(CorruptFile):
            store.read(rows[3])
        for row in good:
            if row.id != rows[3].id:
                store.read(row)


def test_open_removes_images_no_row_points_to_and_nothing_else(tmp_path: Path) -> None:
    fill(tmp_path, 1, per_track=4)
    (tmp_path / "images" / "0123456789abcdef0123.webp").write_bytes(b"x")
    (tmp_path / "images" / ".0123456789abcdef0123.webp.k2j4.tmp").write_bytes(b"x")
    (tmp_path / ".student.ckpt.x8q1.tmp").write_bytes(b"x")
    # A user's files, which the store did not write: they must survive its clean-up.
    users = [tmp_path / "images" / "holiday.webp", tmp_path / "images" / ".config", tmp_path / "a"]
    for path in users:
        path.write_bytes(b"mine")
    store, report = Store.open(tmp_path)
    store.close()
    assert (report.orphans_removed, report.temporaries_removed) == (1, 2)
    assert all(path.read_bytes() == b"mine" for path in users)
    for path in users:
        path.unlink()
    assert _verify_all(tmp_path) == 4


def test_a_new_store_is_refused_in_a_directory_that_holds_other_files(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "frame0.png").write_bytes(b"mine")
    with pytest.raises(StoreError, match="holds files and no store"):
        Store.open(tmp_path)
    assert (tmp_path / "images" / "frame0.png").read_bytes() == b"mine"
    assert not (tmp_path / "store.sqlite").exists()


def test_a_store_open_in_one_process_is_refused_in_another(tmp_path: Path) -> None:
    store, _ = Store.open(tmp_path / "s")
    with store:
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from edgetrain.insitu.store import Store; Store.open({str(tmp_path / 's')!r})",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.returncode == 1 and "is in use by another edgetrain process" in other.stderr
    Store.open(tmp_path / "s")[0].close()  # closed, it opens again


def test_a_damaged_database_page_is_one_clear_error(tmp_path: Path) -> None:
    fill(tmp_path, 3, per_track=6)
    data = bytearray((tmp_path / "store.sqlite").read_bytes())
    page = 4096
    assert len(data) > 3 * page
    data[2 * page : 3 * page] = bytes(random.Random(0).randrange(256) for _ in range(page))
    (tmp_path / "store.sqlite").write_bytes(bytes(data))
    with pytest.raises(CorruptFile, match="not a readable SQLite"):
        Store.open(tmp_path)


def test_the_cap_evicts_the_oldest_image_of_the_largest_label(tmp_path: Path) -> None:
    fill(tmp_path, 4, per_track=6)  # labels 0, 1, 2, 0: label 0 has 12 images
    store, _ = Store.open(tmp_path)
    with store:
        rows, _ = store.rows()
        before = {r.id: r for r in rows}
        store.cap_bytes = store.total_bytes() - 1
        store._evict()
        rows, _ = store.rows()
        gone = set(before) - {r.id for r in rows}
        assert len(gone) == 1
        victim = before[gone.pop()]
        zeros = [r for r in before.values() if r.label == 0]
        assert victim.label == 0 and victim.frame == min(r.frame for r in zeros)
        assert store.total_bytes() <= store.cap_bytes
    assert _verify_all(tmp_path) == 23


def test_a_file_that_is_not_a_database_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "store.sqlite").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(CorruptFile, match="not a readable SQLite"):
        Store.open(tmp_path)


def test_kill_9_during_store_writes_leaves_no_corrupt_row_or_image(tmp_path: Path) -> None:
    rng = random.Random(3)
    committed = 0
    for attempt in range(4):
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.insitu.helpers",
                "write",
                str(tmp_path),
                "200",
                str(1000 * attempt),
            ],
            cwd=ROOT,
        )
        images = tmp_path / "images"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
            images.exists() and any(p.suffix == ".webp" for p in images.iterdir())
        ):
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))  # a random moment of the writing
        assert child.poll() is None, "the writer finished before it could be killed"
        child.send_signal(signal.SIGKILL)
        child.wait()
        count = _verify_all(tmp_path)
        assert count % 12 == 0 and count >= committed  # whole tracks only, nothing lost
        committed = count
    assert committed > 0


def _limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_full_disk_is_one_error_and_loses_nothing_stored(tmp_path: Path) -> None:
    fill(tmp_path, 2, per_track=6)
    size = (tmp_path / "store.sqlite").stat().st_size
    code = (
        "import sys\n"
        "from tests.insitu.helpers import fill\n"
        "from edgetrain.insitu.files import DiskFull\n"
        "try:\n"
        f"    fill(__import__('pathlib').Path({str(tmp_path)!r}), 200, start=2)\n"
        "except DiskFull as exc:\n"
        "    print('DiskFull', exc); sys.exit(2)\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=lambda: _limit_file_size(size + 16384),
        timeout=120,
    )
    assert child.returncode == 2, child.stderr[-2000:]
    assert child.stdout.startswith("DiskFull no room")
    assert _verify_all(tmp_path) >= 12
    assert issubclass(DiskFull, Exception)


def test_rows_of_a_store_are_indexed_by_label_track_frame_time_confidence_source(
    tmp_path: Path,
) -> None:
    fill(tmp_path, 1, per_track=2)
    db = sqlite3.connect(tmp_path / "store.sqlite")
    columns = {r[1] for r in db.execute("PRAGMA table_info(images)")}
    db.close()
    assert {"label", "track", "frame", "time", "confidence", "source"} <= columns
