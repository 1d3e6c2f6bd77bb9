"""Files that survive a crash: atomic writes, and checksummed state files read back verified.

A checksummed file is one line ``edgetrain-state sha256=<hex> bytes=<n>`` followed by the
payload; a torn, truncated or altered file fails the check and raises :class:`CorruptFile`.
Torch state goes through ``torch.save`` and comes back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from edgetrain.errors import CorruptFile, EdgetrainError

_MAGIC = b"edgetrain-state"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFull(EdgetrainError):
    """The disk (or the file-size limit) has no room for a write; nothing written is lost."""


def disk_full(path: Path, exc: OSError) -> DiskFull:
    """The one-line error for a write that ran out of room."""
    return DiskFull(
        f"no room to write {path} ({os.strerror(exc.errno or 0)}); free space on the disk "
        "or lower --store-cap, then run again: what is stored so far is intact"
    )


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``: a crash leaves no file (or the old one) or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.errno in DISK_FULL:
            raise disk_full(path, exc) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    """Write several files into ``directory``, each atomically, with one flush to disk.

    Each file goes to a temporary name first; then one ``syncfs`` (or an ``fsync`` per file where
    ``syncfs`` is missing) makes them durable, they are renamed into place and the directory is
    flushed. A crash leaves some of the files, complete, and temporary files (dot-names), never a
    partial file under a final name.
    """
    directory.mkdir(parents=True, exist_ok=True)
    temporaries: list[tuple[str, Path]] = []
    try:
        for name, data in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
            temporaries.append((name, Path(tmp)))
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                if not _HAS_SYNCFS:
                    handle.flush()
                    os.fsync(handle.fileno())
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            if _HAS_SYNCFS:
                _syncfs(dir_fd)
            for name, tmp in temporaries:
                os.replace(tmp, directory / name)
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        for _, tmp in temporaries:
            tmp.unlink(missing_ok=True)
        if exc.errno in DISK_FULL:
            raise disk_full(directory, exc) from exc
        raise
    except BaseException:
        for _, tmp in temporaries:
            tmp.unlink(missing_ok=True)
        raise


def _load_syncfs() -> tuple[bool, Any]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.syncfs
    except (OSError, AttributeError):
        return False, None

    def call(fd: int) -> None:
        if function(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    return True, call


_HAS_SYNCFS, _syncfs = _load_syncfs()


def write_checked(path: Path, payload: bytes) -> None:
    """Atomically write ``payload`` behind a header with its SHA-256 and length."""
    digest = hashlib.sha256(payload).hexdigest()
    header = _MAGIC + f" sha256={digest} bytes={len(payload)}\n".encode()
    atomic_write_bytes(path, header + payload)


def read_checked(path: Path) -> bytes:
    """The payload of a file :func:`write_checked` wrote; :class:`CorruptFile` if it fails."""
    data = path.read_bytes()
    head, sep, payload = data.partition(b"\n")
    fields = head.split(b" ")
    if not sep or fields[0] != _MAGIC or len(fields) != 3:
        raise CorruptFile(f"{path} is not an edgetrain state file; delete it to start over")
    digest = fields[1].removeprefix(b"sha256=").decode(errors="replace")
    size = fields[2].removeprefix(b"bytes=").decode(errors="replace")
    if size != str(len(payload)) or hashlib.sha256(payload).hexdigest() != digest:
        raise CorruptFile(f"{path} fails its checksum (torn or altered); delete it to start over")
    return payload


def save_state(path: Path, state: dict[str, Any]) -> None:
    """``torch.save`` a dict of tensors, numbers, strings and lists, atomically and checksummed."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_checked(path, buffer.getvalue())


def load_failure(exc: BaseException) -> str:
    """One line saying why ``torch.load`` (or ``load_state_dict``) refused a file: the
    unpickler's own reason when ``weights_only`` refused an object, else the first line of the
    message, without terminal escapes, at most 200 characters."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    unpickler = re.search(r"WeightsUnpickler error: ([^\n]*?\.)(?:\s|$)", text)
    if unpickler:
        return f"weights_only loading refuses it: {unpickler.group(1)}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    return first if len(first) <= 200 else first[:197] + "..."


def load_state(path: Path, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dict :func:`save_state` wrote, verified, loaded with ``weights_only=True``, holding
    ``keys`` (CorruptFile naming the first missing one: another kind of state file)."""
    payload = read_checked(path)
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as exc:  # the checksum passed: another version's file, or a hostile one
        raise CorruptFile(
            f"{path} does not load ({load_failure(exc)}); delete it to start over"
        ) from exc
    if not isinstance(state, dict):
        raise CorruptFile(f"{path} holds no state dict; delete it to start over")
    missing = [key for key in keys if key not in state]
    if missing:
        raise CorruptFile(
            f"{path} is another kind of state file (no {missing[0]!r}); delete it to start over"
        )
    return state
