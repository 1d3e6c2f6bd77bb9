"""``insitu eval`` reports the rows of a tampered store database it skips, by reason, in its JSON
and its table, and exits 0: the good rows are still used."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgetrain.cli.main import cli
from edgetrain.insitu.store import Store
from tests.insitu.helpers import fill


@pytest.fixture
def tampered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGETRAIN_CACHE_DIR", str(tmp_path / "cache"))
    store_dir = tmp_path / "store"
    fill(store_dir, 2, per_track=4)
    source = {"kind": "synthetic", "seed": 0, "frames": 40, "classes": 3, "teacher_views": 4}
    store, _ = Store.open(store_dir)
    with store:
        store.set(source=json.dumps(source))
    db = sqlite3.connect(store_dir / "store.sqlite")
    with db:
        db.execute("UPDATE images SET label = 'abc' WHERE id = 1")
        db.execute("UPDATE images SET label = -7 WHERE id = 2")
        db.execute("UPDATE images SET label = 99 WHERE id = 3")
    db.close()
    return store_dir


def test_eval_counts_skipped_rows_by_reason_in_its_json(tampered: Path) -> None:
    result = CliRunner().invoke(cli, ["insitu", "eval", "--store", str(tampered), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["skipped_rows"] == {
        "count": 3,
        "reasons": {
            "label is not a whole number": 1,
            "label is out of range": 2,
        },
    }


def test_eval_shows_skipped_rows_in_its_table_and_a_note(tampered: Path) -> None:
    result = CliRunner().invoke(cli, ["insitu", "eval", "--store", str(tampered)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "rows skipped (corrupt)" in text
    assert "note: 3 rows of the store were skipped, not trained on" in text
