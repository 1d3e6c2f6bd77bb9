"""The node's local training set: 224 x 224 crops as WebP files, indexed in SQLite.

Layout of a store directory::

    store.sqlite     images (label, track, frame, time, confidence, source, file, sha256, bytes),
                     crops (every tracked crop, labelled or not: what a resume skips), meta
    images/<sha256[:20]>.webp
    store.lock       held (``flock``) by the one process that has the store open

A new store is made only in a new or empty directory, and the store deletes only files it
names itself (its image names, their temporary files, its checkpoint's temporary files): a
user's files are never touched. Its database carries the store's mark (SQLite's
``application_id``, :data:`APPLICATION_ID`), written when it is made: a ``store.sqlite`` without
it is someone else's database and is refused before anything in the directory changes (no
journal mode set, no table added, no file created); a store made before the mark existed (exactly
the store's tables) is marked at its next open. One process at a time: a second one
opening the store gets one line saying it is in use.

Crash safety. A track's images are written first, each atomically (temporary file, fsync,
rename), then its rows in one SQLite transaction. A crash before the commit leaves image files
no row points to; :meth:`Store.open` deletes them (and stray temporary files) and reports how
many. An image is deleted only when no row claims it, by its name or by its SHA-256 (the name is
the hash's first 20 hex digits): a row whose ``file`` was damaged gets its name back from its
hash. A row is never written before its image is on disk, so no row points to a missing file.
Each row keeps its image's SHA-256: an image altered or torn later is detected when read,
skipped and reported (:meth:`Store.images`), never trained on.

Files the store trusts. The database is a file anyone holding the card can edit, so every row is
checked before use (:meth:`Store.rows`): a row whose values have the wrong type or range, whose
hash is not 64 hex digits or whose file is not the name the store gives that hash (a relative
path such as ``../../victim.txt``, an absolute path, ``..``) is skipped with its reason, and the
reasons are counted in the report. An image is read only as a regular file directly in the
``images`` folder, never through a symlink (the file's or the folder's), and only when its size
is the one its row records. Eviction deletes a row's file only when it is such an image file and
the store's name for that row's own hash: whatever else a row names stays untouched.

Size cap. When the images exceed ``cap_bytes``, the store evicts the oldest image (by frame) of
the label with the most images, until it fits: the set stays balanced across labels and the
newest views are kept.

Ground truth (synthetic scenes only) sits in the ``crops`` table's ``true_label`` column, read by
evaluation only; the trainer reads the ``images`` table.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import os
import re
import sqlite3
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
from PIL import Image

from edgetrain.errors import CorruptFile, EdgetrainError, InvalidInput
from edgetrain.insitu.files import DISK_FULL, DiskFull, write_files

WEBP_QUALITY = 80  # Pillow WebP quality (<= 80); 224^2 crops of the synthetic scene average ~2 KB

_SCHEMA = """
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


class UnreadableImage(CorruptFile):
    """A row's image that the store does not read (missing, altered, not its own file);
    ``reason`` is one of a few fixed phrases, so that reasons can be counted."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


_IMAGE = re.compile(r"[0-9a-f]{20}\.webp")
"""The name of an image the store writes (the first 20 hex digits of its SHA-256)."""
_NOT_OWN = "file is not the store's name for its image (a path or another name)"
_TEMPORARY = re.compile(r"\.([0-9a-f]{20}\.webp|student\.ckpt)\..+\.tmp")
"""A temporary file of one of the store's writes (an image, the student's checkpoint)."""


def _raise_sqlite(exc: sqlite3.Error, path: Path, doing: str) -> NoReturn:
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


def _connect(db_path: Path) -> sqlite3.Connection:
    """The store's database, its schema made and its pages checked (``PRAGMA quick_check``);
    one-line errors for what the user can mend (see :func:`_raise_sqlite`)."""
    try:
        db = sqlite3.connect(db_path, isolation_level=None, timeout=30)
    except sqlite3.Error as exc:
        _raise_sqlite(exc, db_path, "open")
    try:
        db.execute("PRAGMA journal_mode=DELETE")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        check = db.execute("PRAGMA quick_check").fetchone()
    except BaseException as exc:
        db.close()
        if isinstance(exc, sqlite3.Error):
            _raise_sqlite(exc, db_path, "open")
        raise
    if check is None or check[0] != "ok":
        db.close()
        raise CorruptFile(
            f"{db_path} is not a readable SQLite database (SQLite's check: "
            f"{check and check[0]}); move the store away and start a new one with another "
            "--store"
        )
    return db


@dataclass(frozen=True)
class Crop:
    """One tracked crop waiting for its track's label.

    ``image`` is the 224 x 224 x 3 uint8 crop (BGR); ``box`` is (x0, y0, x1, y1) in the frame;
    ``confidence`` the teacher's top probability on it; ``vote`` whether it counted as a vote;
    ``true_label``/``angle_deg`` ground truth when the scene knows it (-1 / None otherwise).
    """

    frame: int
    seconds: float
    box: tuple[int, int, int, int]
    image: np.ndarray
    confidence: float
    teacher_label: int
    vote: bool
    true_label: int = -1
    angle_deg: float | None = None


@dataclass(frozen=True)
class StoredImage:
    """A row of the ``images`` table."""

    id: int
    file: str
    sha256: str
    bytes: int
    label: int
    track: int
    frame: int
    seconds: float
    confidence: float
    source: str


@dataclass(frozen=True)
class SkippedRow:
    """A row of the ``images`` table the store skips (never reads, never trains on) and why:
    ``reason`` is one of a few fixed phrases, so that reasons can be counted."""

    id: object
    reason: str

    def __str__(self) -> str:
        return f"row {self.id}: {self.reason}"


def count_reasons(reasons: list[str]) -> dict[str, int]:
    """How many skipped rows there are of each reason, most frequent first."""
    counts: dict[str, int] = {}
    for reason in reasons:
        counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _row_or_reason(raw: tuple[object, ...], classes: int | None) -> StoredImage | str:
    """The row ``raw`` (id, file, sha256, bytes, label, track, frame, time, confidence, source)
    of the ``images`` table, or why it is skipped: values of the wrong type or range, a hash
    that is not 64 hex digits, a file name that is not the image name the store gives that hash
    (a path, ``..``, another name)."""
    whole: dict[str, int] = {}
    names = ("id", "bytes", "label", "track", "frame")
    for name, value in zip(names, raw[:1] + raw[3:7], strict=True):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} is not a whole number"
        whole[name] = value
    real: dict[str, float] = {}
    for name, value in zip(("time", "confidence"), raw[7:9], strict=True):
        if not isinstance(value, int | float) or isinstance(value, bool) or not np.isfinite(value):
            return f"{name} is not a finite number"
        real[name] = float(value)
    file, digest, source = raw[1], raw[2], raw[9]
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return "sha256 is not 64 hex digits"
    if not isinstance(file, str) or file != f"{digest[:20]}.webp":
        return _NOT_OWN
    if whole["label"] < 0 or (classes is not None and whole["label"] >= classes):
        return "label is out of range"
    if whole["bytes"] < 0:
        return "bytes is negative"
    if not isinstance(source, str):
        return "source is not text"
    return StoredImage(
        whole["id"],
        file,
        digest,
        whole["bytes"],
        whole["label"],
        whole["track"],
        whole["frame"],
        real["time"],
        real["confidence"],
        source,
    )


@dataclass(frozen=True)
class OpenReport:
    """What :meth:`Store.open` cleaned up: image files without a row, temporary files, and rows
    whose damaged ``file`` it named again from their hash."""

    orphans_removed: int
    temporaries_removed: int
    rows_repaired: int = 0


def encode_webp(image: np.ndarray) -> bytes:
    """A BGR uint8 crop as WebP bytes at :data:`WEBP_QUALITY`."""
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image[..., ::-1])).save(
        buffer, format="WEBP", quality=WEBP_QUALITY, method=1
    )
    return buffer.getvalue()


def decode_image(data: bytes) -> np.ndarray:
    """WebP (or any Pillow image) bytes to a BGR uint8 array; raises on a broken image."""
    with Image.open(io.BytesIO(data)) as image:
        rgb = np.asarray(image.convert("RGB"))
    return np.ascontiguousarray(rgb[..., ::-1])


class Store:
    """A store directory. Use :meth:`open`; close with :meth:`close` (or ``with``)."""

    def __init__(
        self, directory: Path, db: sqlite3.Connection, cap_bytes: int | None, lock: int
    ) -> None:
        self.directory = directory
        self.images_dir = directory / "images"
        self.db = db
        self.cap_bytes = cap_bytes
        self.evicted = 0
        self._lock = lock

    @classmethod
    def open(
        cls, directory: str | Path, *, cap_bytes: int | None = None, create: bool = True
    ) -> tuple[Store, OpenReport]:
        """Open (or create) a store and clean what an interrupted write left behind."""
        path = Path(directory)
        if path.exists() and not path.is_dir():
            raise InvalidInput(f"store {path} is a file, not a directory; give a directory")
        db_path = path / "store.sqlite"
        marked = True
        if db_path.exists():
            marked = _is_marked(db_path)  # refuses another's database before any change
        else:
            if not create:
                raise StoreError(
                    f"{path} is not an in-situ store (no store.sqlite); run `insitu run`"
                )
            if _holds_other_files(path):
                raise StoreError(
                    f"{path} holds files and no store (no store.sqlite); give a new or empty "
                    "directory for the store, so that none of those files is touched"
                )
        try:
            (path / "images").mkdir(parents=True, exist_ok=True)
            lock = _lock(path / "store.lock")
        except OSError as exc:
            if exc.errno in DISK_FULL:
                raise DiskFull(f"no room to create the store in {path}; free space") from exc
            raise InvalidInput(f"cannot create the store in {path}: {exc.strerror}") from exc
        try:
            if not db_path.exists():
                _create_database(db_path)
            store = cls(path, _connect(db_path), cap_bytes, lock)
            if not marked:
                store.db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        except BaseException:
            os.close(lock)
            raise
        try:
            return store, store._clean()
        except BaseException:
            store.close()  # the lock too: this process may open the store again
            raise

    def close(self) -> None:
        self.db.close()
        if self._lock >= 0:
            os.close(self._lock)  # releases the flock
            self._lock = -1

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _clean(self) -> OpenReport:
        """Delete what an interrupted write left: images no row names, temporary files of the
        store's own writes. Any other file is left alone."""
        repaired = self._repair_names()
        known = _claimed_names(self.db)
        orphans = temporaries = 0
        for path in [*self.images_dir.iterdir(), *self.directory.iterdir()]:
            if _TEMPORARY.fullmatch(path.name):
                path.unlink(missing_ok=True)
                temporaries += 1
            elif (
                path.parent == self.images_dir
                and _IMAGE.fullmatch(path.name)
                and path.name not in known
            ):
                path.unlink(missing_ok=True)
                orphans += 1
        return OpenReport(orphans, temporaries, repaired)

    def _repair_names(self) -> int:
        """Give each row whose ``file`` is not its image's name (the first 20 hex digits of its
        ``sha256`` + ``.webp``) that name back, when that image is on disk and no other row
        holds the name; returns how many rows were repaired."""
        fixes: list[tuple[str, int]] = []
        taken = {str(row[0]) for row in self.db.execute("SELECT file FROM images")}
        for row_id, file, digest in self.db.execute("SELECT id, file, sha256 FROM images"):
            name = _name_of(digest)
            if name is None or file == name or name in taken:
                continue
            if (self.images_dir / name).is_file():
                fixes.append((name, int(row_id)))
                taken.add(name)
        if fixes:
            with self._transaction() as db:
                db.executemany("UPDATE images SET file = ? WHERE id = ?", fixes)
        return len(fixes)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
        except sqlite3.Error as exc:
            _raise_sqlite(exc, self.directory / "store.sqlite", "write")

    # -- meta -----------------------------------------------------------------------------
    def get(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else str(row[0])

    def get_int(self, key: str) -> int:
        """A whole number kept in the store's meta table (0 when absent); CorruptFile when the
        value there is not one."""
        text = self.get(key)
        try:
            return int(text) if text else 0
        except ValueError as exc:
            raise CorruptFile(
                f"{self.directory / 'store.sqlite'}: meta {key!r} is {text!r}, not a whole "
                "number; move the store away and start a new one with another --store"
            ) from exc

    def set(self, **values: object) -> None:
        with self._transaction() as db:
            self._set(db, values)

    @staticmethod
    def _set(db: sqlite3.Connection, values: dict[str, object]) -> None:
        db.executemany(
            "INSERT INTO meta(key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            [(k, str(v)) for k, v in values.items()],
        )

    # -- writing --------------------------------------------------------------------------
    def add_track(
        self, track: int, crops: list[Crop], label: int | None, meta: dict[str, object]
    ) -> int:
        """Store a finished track: its images when it has a ``label``, its crops either way,
        and ``meta`` in the same transaction. Returns the number of images written."""
        files: list[tuple[Crop, str, str, int]] = []
        if label is not None:
            contents: dict[str, bytes] = {}
            for crop in crops:
                data = encode_webp(crop.image)
                digest = hashlib.sha256(data).hexdigest()
                name = f"{digest[:20]}.webp"
                contents[name] = data
                files.append((crop, name, digest, len(data)))
            write_files(self.images_dir, contents)
        with self._transaction() as db:
            for crop, name, digest, size in files:
                agrees = crop.vote and crop.teacher_label == label
                db.execute(
                    "INSERT OR IGNORE INTO images(file, sha256, bytes, label, track, frame, time,"
                    " confidence, source) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        name,
                        digest,
                        size,
                        label,
                        track,
                        crop.frame,
                        crop.seconds,
                        crop.confidence,
                        "teacher" if agrees else "track",
                    ),
                )
            db.executemany(
                "INSERT INTO crops(frame, x0, y0, x1, y1, track, label, true_label, angle)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        c.frame,
                        *c.box,
                        track,
                        -1 if label is None else label,
                        c.true_label,
                        c.angle_deg,
                    )
                    for c in crops
                ],
            )
            self._set(db, meta)
        self._evict()
        return len(files)

    def _evict(self) -> None:
        if self.cap_bytes is None:
            return
        while self.total_bytes() > self.cap_bytes:
            row = self.db.execute(
                "SELECT id, file, sha256 FROM images WHERE label = (SELECT label FROM images "
                "GROUP BY label ORDER BY COUNT(*) DESC, label LIMIT 1) ORDER BY frame, id LIMIT 1"
            ).fetchone()
            if row is None:
                return
            with self._transaction() as db:
                db.execute("DELETE FROM images WHERE id = ?", (row[0],))
            own = self._own_image_file(row[1], row[2])
            if own is not None:
                own.unlink(missing_ok=True)  # a crash here leaves an orphan
            self.evicted += 1

    def _own_image_file(self, name: object, digest: object) -> Path | None:
        """The path of the image file ``name`` of a row with hash ``digest`` when it is one the
        store wrote: the store's name for that hash, a regular file (no symlink) directly in the
        ``images`` folder (itself no symlink). Anything else a row names is never deleted."""
        if not isinstance(name, str) or not _IMAGE.fullmatch(name):
            return None
        if not isinstance(digest, str) or name != f"{digest[:20]}.webp":
            return None  # another row's image, or none: an unclaimed one goes at the next open
        if self.images_dir.is_symlink():
            return None
        path = self.images_dir / name
        try:
            info = path.lstat()
        except OSError:
            return None
        return path if stat.S_ISREG(info.st_mode) else None

    # -- reading --------------------------------------------------------------------------
    def total_bytes(self) -> int:
        return int(self.db.execute("SELECT COALESCE(SUM(bytes), 0) FROM images").fetchone()[0])

    def count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM images").fetchone()[0])

    def rows(self, classes: int | None = None) -> tuple[list[StoredImage], list[SkippedRow]]:
        """Every well-formed row, by id, and each row skipped with its reason (see
        :func:`_row_or_reason`); with ``classes``, a label not below it is skipped too."""
        good: list[StoredImage] = []
        skipped: list[SkippedRow] = []
        for raw in self.db.execute(
            "SELECT id, file, sha256, bytes, label, track, frame, time, confidence, source "
            "FROM images ORDER BY id"
        ):
            row = _row_or_reason(tuple(raw), classes)
            if isinstance(row, StoredImage):
                good.append(row)
            else:
                skipped.append(SkippedRow(raw[0], row))
        return good, skipped

    def read(self, row: StoredImage) -> np.ndarray:
        """The image of ``row``, verified against its checksum; raises :class:`UnreadableImage`
        if it fails, or if its file is not one the store wrote (see :meth:`_read_own`)."""
        data = self._read_own(row)
        if hashlib.sha256(data).hexdigest() != row.sha256:
            raise UnreadableImage(
                f"image {row.file} of row {row.id} fails its checksum", "image fails its checksum"
            )
        try:
            return decode_image(data)
        except Exception as exc:
            raise UnreadableImage(
                f"image {row.file} of row {row.id} does not decode", "image does not decode"
            ) from exc

    def _read_own(self, row: StoredImage) -> bytes:
        """The bytes of ``row``'s image: a regular file named as the store names its images,
        directly in its ``images`` folder (itself no symlink), not followed through a symlink,
        of the size the row records; :class:`UnreadableImage` naming the problem otherwise."""
        where = f"image {row.file!r} of row {row.id}"
        if not _IMAGE.fullmatch(row.file):
            raise UnreadableImage(f"{where} is not an image name of the store", _NOT_OWN)
        if self.images_dir.is_symlink():
            raise UnreadableImage(
                f"{self.images_dir} is a symlink; the store reads no image through it",
                "the images folder is a symlink",
            )
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self.images_dir / row.file, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnreadableImage(
                    f"{where} is a symlink; the store reads only its own files",
                    "image is a symlink",
                ) from exc
            raise UnreadableImage(f"{where} is missing", "image is missing") from exc
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise UnreadableImage(f"{where} is not a file", "image is not a regular file")
            if info.st_size != row.bytes:
                raise UnreadableImage(
                    f"{where} has {info.st_size} bytes, not the {row.bytes} its row records",
                    "image has the wrong size",
                )
            return handle.read(row.bytes + 1)

    def crops(self) -> list[tuple[int, int, int, int, int, int, int, int, float | None]]:
        """Every tracked crop: (frame, x0, y0, x1, y1, track, label, true_label, angle)."""
        return [
            tuple(r)
            for r in self.db.execute(  # type: ignore[misc]
                "SELECT frame, x0, y0, x1, y1, track, label, true_label, angle "
                "FROM crops ORDER BY id"
            )
        ]

    def seen_boxes(self, frame: int) -> list[tuple[int, int, int, int]]:
        """Boxes of crops already stored for ``frame`` (a resumed run skips them)."""
        return [
            (int(r[0]), int(r[1]), int(r[2]), int(r[3]))
            for r in self.db.execute("SELECT x0, y0, x1, y1 FROM crops WHERE frame = ?", (frame,))
        ]


def _holds_other_files(path: Path) -> bool:
    """Whether ``path`` has anything in it but an empty ``images`` folder (what a store's
    creation leaves before its database exists)."""
    if not path.is_dir():
        return False
    for entry in path.iterdir():
        if entry.name in ("store.lock", _NEW_DATABASE, f"{_NEW_DATABASE}-journal"):
            continue
        if entry.name != "images" or not entry.is_dir() or any(entry.iterdir()):
            return True
    return False


def _lock(path: Path) -> int:
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

_NEW_DATABASE = ".store.sqlite.new"
"""Where a new database is made (under the store's lock) before it is renamed ``store.sqlite``."""

_HEADER = b"SQLite format 3\x00"


def _name_of(digest: object) -> str | None:
    """The image name of a row's ``sha256`` (None when the hash is not 64 hex digits)."""
    text = str(digest)
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        return None
    return f"{text[:20]}.webp"


def _claimed_names(db: sqlite3.Connection) -> set[str]:
    """Every image name a row claims: its ``file``, and the name its ``sha256`` gives."""
    names: set[str] = set()
    for file, digest in db.execute("SELECT file, sha256 FROM images"):
        names.add(str(file))
        name = _name_of(digest)
        if name is not None:
            names.add(name)
    return names


def _is_marked(db_path: Path) -> bool:
    """True when ``db_path`` is a store's database with the mark; False for one the store made
    before it wrote the mark (exactly the store's tables, not in WAL mode); StoreError for any
    other SQLite database and CorruptFile for a file that is not one. Reads only: the file, its
    journal and its directory are left as they are."""
    try:
        with open(db_path, "rb") as handle:
            header = handle.read(100)
    except OSError as exc:
        raise InvalidInput(f"cannot read {db_path} ({exc.strerror}); check the directory") from exc
    if len(header) < 100 or not header.startswith(_HEADER):
        raise CorruptFile(
            f"{db_path} is not a readable SQLite database (no SQLite header); move the store "
            "away and start a new one with another --store"
        )
    if int.from_bytes(header[68:72], "big") == APPLICATION_ID:
        return True
    unmarked = int.from_bytes(header[68:72], "big") == 0 and header[18:20] == b"\x01\x01"
    if unmarked and _has_store_schema(db_path):
        return False
    raise StoreError(
        f"{db_path} is an SQLite database edgetrain did not create; it is left untouched: "
        "give --store a new or empty directory"
    )


def _has_store_schema(db_path: Path) -> bool:
    """Whether the database holds exactly the store's tables and index (read-only; False when it
    cannot be read without writing, e.g. it has a journal to roll back)."""
    expected = sqlite3.connect(":memory:")
    try:
        expected.executescript(_SCHEMA)
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


def _create_database(db_path: Path) -> None:
    """Make the store's database, with its mark and tables, as ``db_path`` in one step: built
    under a temporary name, flushed, then renamed (a crash leaves no half-made database)."""
    new = db_path.with_name(_NEW_DATABASE)
    new.unlink(missing_ok=True)
    Path(f"{new}-journal").unlink(missing_ok=True)
    try:
        db = sqlite3.connect(new, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=DELETE")
            db.executescript(f"BEGIN; PRAGMA application_id = {APPLICATION_ID}; {_SCHEMA} COMMIT;")
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
        _raise_sqlite(exc, db_path, "create")
    except OSError as exc:
        new.unlink(missing_ok=True)
        if exc.errno in DISK_FULL:
            raise DiskFull(f"no room to create the store in {db_path.parent}; free space") from exc
        raise InvalidInput(f"cannot create {db_path}: {exc.strerror}") from exc
