"""The in-situ store's own SQLite database: its schema and its mark
(:data:`APPLICATION_ID`), making it in one step, opening it with its pages checked, telling a
store's database from someone else's, the lock one process holds, and one-line errors for what
the user can mend."""

from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
from pathlib import Path
from typing import NoReturn

from edgetrain.errors import CorruptFile, EdgetrainError, InvalidInput
from edgetrain.insitu.files import DISK_FULL, DiskFull

SCHEMA = """
CREATE TABLE IF NOT EXISTS images (
    id INTEGER PRIMARY KEY,
    file TEXT NOT NULL UNIQUE,
    sha256 TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    label INTEGER NOT NULL,
    track INTEGER NOT NULL,
    frame INTEGER NOT NULL,
    time REAL NOT NULL,
    confidence REAL NOT NULL,
    source TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS crops (
    id INTEGER PRIMARY KEY,
    frame INTEGER NOT NULL,
    x0 INTEGER NOT NULL, y0 INTEGER NOT NULL, x1 INTEGER NOT NULL, y1 INTEGER NOT NULL,
    track INTEGER NOT NULL,
    label INTEGER NOT NULL,        -- the propagated label, -1 when the track was dropped
    true_label INTEGER NOT NULL,   -- ground truth (synthetic scenes), -1 when unknown
    angle REAL                     -- ground-truth off-axis angle, degrees (synthetic scenes)
);
CREATE INDEX IF NOT EXISTS crops_frame ON crops(frame);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class StoreError(EdgetrainError):
    """The store cannot be used (not a store, or empty when images are needed)."""


def raise_sqlite(exc: sqlite3.Error, path: Path, doing: str) -> NoReturn:
    """Raise the one-line error for a failed SQLite call on the store's database ``path``, or
    ``exc`` itself for what is a bug, not the user's (a constraint, misuse, an SQL error)."""
    name = getattr(exc, "sqlite_errorname", "")
    if name.startswith(("SQLITE_CONSTRAINT", "SQLITE_MISUSE")) or name == "SQLITE_ERROR":
        raise exc
    if name in ("SQLITE_FULL", "SQLITE_IOERR_WRITE", "SQLITE_IOERR_FSYNC", "SQLITE_IOERR_TRUNCATE"):
        # A write past the disk's room or the file-size limit reads "disk I/O error".
        raise DiskFull(
            f"no room to {doing} {path} ({exc}); free space on the disk or lower --store-cap, "
            "then run again: what is stored is intact"
        ) from exc
    damaged = name in ("SQLITE_CORRUPT", "SQLITE_NOTADB")
    if damaged or (isinstance(exc, sqlite3.DatabaseError) and not name):
        raise CorruptFile(
            f"{path} is not a readable SQLite database ({exc}); move the store away and start a "
            "new one with another --store"
        ) from exc
    raise InvalidInput(f"cannot {doing} {path} ({exc}); check the directory") from exc


def connect(db_path: Path) -> sqlite3.Connection:
    """The store's database, its schema made and its pages checked (``PRAGMA quick_check``);
    one-line errors for what the user can mend (see :func:`raise_sqlite`)."""
    try:
        db = sqlite3.connect(db_path, isolation_level=None, timeout=30)
    except sqlite3.Error as exc:
        raise_sqlite(exc, db_path, "open")
    try:
        db.execute("PRAGMA journal_mode=DELETE")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(SCHEMA)
        check = db.execute("PRAGMA quick_check").fetchone()
    except BaseException as exc:
        db.close()
        if isinstance(exc, sqlite3.Error):
            raise_sqlite(exc, db_path, "open")
        raise
    if check is None or check[0] != "ok":
        db.close()
        raise CorruptFile(
            f"{db_path} is not a readable SQLite database (SQLite's check: "
            f"{check and check[0]}); move the store away and start a new one with another "
            "--store"
        )
    return db


def holds_other_files(path: Path) -> bool:
    """Whether ``path`` has anything in it but an empty ``images`` folder (what a store's
    creation leaves before its database exists)."""
    if not path.is_dir():
        return False
    for entry in path.iterdir():
        if entry.name in ("store.lock", NEW_DATABASE, f"{NEW_DATABASE}-journal"):
            continue
        if entry.name != "images" or not entry.is_dir() or any(entry.iterdir()):
            return True
    return False


def lock_file(path: Path) -> int:
    """An exclusive ``flock`` on ``path`` (created if needed), held by the returned descriptor
    until it is closed; StoreError when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StoreError(
                f"the store {path.parent} is in use by another edgetrain process (or is open "
                "already in this one); wait for it to finish, or give another --store"
            ) from exc
        raise
    return fd


# -- the store's own database ------------------------------------------------------------------

APPLICATION_ID = int.from_bytes(b"edgT", "big")
"""SQLite ``PRAGMA application_id`` of a store's database: the mark of a database the store made
(bytes 68-71 of the file's header)."""

NEW_DATABASE = ".store.sqlite.new"
"""Where a new database is made (under the store's lock) before it is renamed ``store.sqlite``."""

HEADER = b"SQLite format 3\x00"


def name_of(digest: object) -> str | None:
    """The image name of a row's ``sha256`` (None when the hash is not 64 hex digits)."""
    text = str(digest)
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        return None
    return f"{text[:20]}.webp"


def claimed_names(db: sqlite3.Connection) -> set[str]:
    """Every image name a row claims: its ``file``, and the name its ``sha256`` gives."""
    names: set[str] = set()
    for file, digest in db.execute("SELECT file, sha256 FROM images"):
        names.add(str(file))
        name = name_of(digest)
        if name is not None:
            names.add(name)
    return names


def is_marked(db_path: Path) -> bool:
    """True when ``db_path`` is a store's database with the mark; False for an unmarked one
    holding exactly the store's tables (not in WAL mode); StoreError for any
    other SQLite database and CorruptFile for a file that is not one. Reads only: the file, its
    journal and its directory are left as they are."""
    try:
        with open(db_path, "rb") as handle:
            header = handle.read(100)
    except OSError as exc:
        raise InvalidInput(f"cannot read {db_path} ({exc.strerror}); check the directory") from exc
    if len(header) < 100 or not header.startswith(HEADER):
        raise CorruptFile(
            f"{db_path} is not a readable SQLite database (no SQLite header); move the store "
            "away and start a new one with another --store"
        )
    if int.from_bytes(header[68:72], "big") == APPLICATION_ID:
        return True
    unmarked = int.from_bytes(header[68:72], "big") == 0 and header[18:20] == b"\x01\x01"
    if unmarked and has_store_schema(db_path):
        return False
    raise StoreError(
        f"{db_path} is an SQLite database edgetrain did not create; it is left untouched: "
        "give --store a new or empty directory"
    )


def has_store_schema(db_path: Path) -> bool:
    """Whether the database holds exactly the store's tables and index (read-only; False when it
    cannot be read without writing, e.g. it has a journal to roll back)."""
    expected = sqlite3.connect(":memory:")
    try:
        expected.executescript(SCHEMA)
        want = set(expected.execute("SELECT type, name, tbl_name, sql FROM sqlite_master"))
    finally:
        expected.close()
    if Path(f"{db_path}-journal").exists() or Path(f"{db_path}-wal").exists():
        return False
    try:
        db = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return False
    try:
        have = set(db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master"))
    except sqlite3.Error:
        return False
    finally:
        db.close()
    return have == want


def create_database(db_path: Path) -> None:
    """Make the store's database, with its mark and tables, as ``db_path`` in one step: built
    under a temporary name, flushed, then renamed (a crash leaves no half-made database)."""
    new = db_path.with_name(NEW_DATABASE)
    new.unlink(missing_ok=True)
    Path(f"{new}-journal").unlink(missing_ok=True)
    try:
        db = sqlite3.connect(new, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=DELETE")
            db.executescript(f"BEGIN; PRAGMA application_id = {APPLICATION_ID}; {SCHEMA} COMMIT;")
        finally:
            db.close()
        with open(new, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(new, db_path)
        directory = os.open(db_path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except sqlite3.Error as exc:
        new.unlink(missing_ok=True)
        raise_sqlite(exc, db_path, "create")
    except OSError as exc:
        new.unlink(missing_ok=True)
        if exc.errno in DISK_FULL:
            raise DiskFull(f"no room to create the store in {db_path.parent}; free space") from exc
        raise InvalidInput(f"cannot create {db_path}: {exc.strerror}") from exc
