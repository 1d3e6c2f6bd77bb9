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
journal mode set, no table added, no file created); an unmarked database holding exactly the
store's tables is marked at its next open. One process at a time: a second one
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

import numpy as np
from PIL import Image

from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.insitu.database import (
    APPLICATION_ID,
    StoreError,
    claimed_names,
    connect,
    create_database,
    holds_other_files,
    is_marked,
    lock_file,
    name_of,
    raise_sqlite,
)
from edgetrain.insitu.files import DISK_FULL, DiskFull, write_files

WEBP_QUALITY = 80  # Pillow WebP quality (<= 80); 224^2 crops of the synthetic scene average ~2 KB


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
            marked = is_marked(db_path)  # refuses another's database before any change
        else:
            if not create:
                raise StoreError(
                    f"{path} is not an in-situ store (no store.sqlite); run `insitu run`"
                )
            if holds_other_files(path):
                raise StoreError(
                    f"{path} holds files and no store (no store.sqlite); give a new or empty "
                    "directory for the store, so that none of those files is touched"
                )
        try:
            (path / "images").mkdir(parents=True, exist_ok=True)
            lock = lock_file(path / "store.lock")
        except OSError as exc:
            if exc.errno in DISK_FULL:
                raise DiskFull(f"no room to create the store in {path}; free space") from exc
            raise InvalidInput(f"cannot create the store in {path}: {exc.strerror}") from exc
        try:
            if not db_path.exists():
                create_database(db_path)
            store = cls(path, connect(db_path), cap_bytes, lock)
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
        known = claimed_names(self.db)
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
            name = name_of(digest)
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
            raise_sqlite(exc, self.directory / "store.sqlite", "write")

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
