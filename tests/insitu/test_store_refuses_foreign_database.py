"""A store opens only a database it made (its mark), and never changes anyone else's."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgetrain.cli.main import cli
from edgetrain.insitu.database import APPLICATION_ID, SCHEMA
from edgetrain.insitu.store import Store, StoreError
from tests.insitu.helpers import fill


def _snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` and the SHA-256 of its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _users_database(directory: Path, journal: str) -> None:
    directory.mkdir(exist_ok=True)
    db = sqlite3.connect(directory / "store.sqlite")
    db.execute(f"PRAGMA journal_mode={journal}")
    db.execute("CREATE TABLE inventory (item TEXT, count INTEGER)")
    db.execute("INSERT INTO inventory VALUES ('bolts', 40)")
    db.commit()
    db.close()


def _application_id(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[68:72], "big")


@pytest.mark.parametrize("journal", ["wal", "delete"])
def test_a_users_own_database_is_refused_and_left_byte_for_byte(tmp_path, journal):
    _users_database(tmp_path, journal)
    before = _snapshot(tmp_path)
    with pytest.raises(StoreError) as caught:
        Store.open(tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    assert "an SQLite database edgetrain did not create; it is left untouched" in message
    assert _snapshot(tmp_path) == before  # no images/, no store.lock, no journal-mode change
    db = sqlite3.connect(tmp_path / "store.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == journal
    assert [r[0] for r in db.execute("SELECT name FROM sqlite_master")] == ["inventory"]
    db.close()


@pytest.mark.parametrize("command", ["run", "eval"])
def test_the_cli_refuses_a_users_database_in_one_line_exit_2(tmp_path, command):
    _users_database(tmp_path / "mine", "wal")
    before = _snapshot(tmp_path / "mine")
    args = ["insitu", command, "--store", str(tmp_path / "mine")]
    if command == "run":
        args += ["--frames", "60", "--classes", "2", "--teacher-views", "10", "--minutes", "1"]
    result = CliRunner().invoke(cli, args, env={"EDGETRAIN_PROGRESS": "0"})
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "edgetrain did not create" in lines[0], result.output
    assert _snapshot(tmp_path / "mine") == before


def test_a_database_with_the_store_tables_but_other_content_elsewhere_is_refused(tmp_path):
    db = sqlite3.connect(tmp_path / "store.sqlite")
    db.executescript(SCHEMA + "CREATE TABLE notes (text TEXT);")
    db.close()
    before = _snapshot(tmp_path)
    with pytest.raises(StoreError, match="did not create"):
        Store.open(tmp_path)
    assert _snapshot(tmp_path) == before


def test_a_new_store_carries_the_mark(tmp_path):
    fill(tmp_path, 1, per_track=2)
    assert _application_id(tmp_path / "store.sqlite") == APPLICATION_ID
    assert not list(tmp_path.glob(".store.sqlite.new*"))


def test_a_store_made_before_the_mark_is_opened_and_marked(tmp_path):
    fill(tmp_path, 2, per_track=3)
    db = sqlite3.connect(tmp_path / "store.sqlite")
    db.execute("PRAGMA application_id = 0")
    db.commit()
    db.close()
    store, _ = Store.open(tmp_path)
    with store:
        assert store.count() == 6
    assert _application_id(tmp_path / "store.sqlite") == APPLICATION_ID


def test_a_half_made_database_left_by_a_crash_does_not_block_a_new_store(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / ".store.sqlite.new").write_bytes(b"SQLite format 3\x00" + b"\x00" * 50)
    fill(tmp_path, 1, per_track=2)
    assert _application_id(tmp_path / "store.sqlite") == APPLICATION_ID
    assert not (tmp_path / ".store.sqlite.new").exists()
