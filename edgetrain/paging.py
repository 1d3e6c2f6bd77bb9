"""PageStore: tensors paged out to files in a directory (the "SD card") and back, safely.

The store :class:`~edgetrain.execute.Checkpointed` pages activations to (``Po``/``Pi`` operations):

* :meth:`PageStore.put` hands a tensor (or a tuple, list or dict of them) to a background writer
  thread and returns at once, so the write overlaps compute; the writer serialises it into a
  temporary file, fsyncs it and renames it into place (a crash leaves no half-written page under
  a page's name), then drops its reference;
* every page carries the SHA-256 of its bytes; :meth:`PageStore.take` waits for the write, reads
  the file back, checks the checksum, loads it with ``torch.load(weights_only=True)`` and deletes
  the file — a page is used once;
* a write that fails (directory not writable, disk full) is reported by the next call as one
  line (:class:`~edgetrain.errors.InvalidInput`); a missing or corrupted page file is
  :class:`~edgetrain.errors.CorruptFile`. :meth:`close` removes whatever pages are left.

The directory is the user's: the store writes only files named ``edgetrain-page-*`` and removes
only those.
"""

from __future__ import annotations

import hashlib
import io
import os
import queue
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.schedule import atomic_write_bytes

_PREFIX = "edgetrain-page-"


class PageStore:
    """Pages of tensors in ``directory``, written by one background thread.

    Use as a context manager, or call :meth:`close`. Keys are any strings unique among the pages
    alive at once.
    """

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        if not path.is_dir():
            raise InvalidInput(f"paging directory {path} does not exist; create it or name another")
        if not os.access(path, os.W_OK):
            raise InvalidInput(f"cannot write to paging directory {path}; name a writable one")
        self.directory = path
        self.bytes_written = 0
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._checksums: dict[str, str] = {}
        self._done: dict[str, threading.Event] = {}
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._write_loop, name="edgetrain-pager", daemon=True
        )
        self._thread.start()

    # -- public ------------------------------------------------------------------------------------

    def put(self, key: str, value: Any) -> None:
        """Page ``value`` (tensors, detached) out under ``key``; returns before the write ends."""
        self._raise_pending()
        if key in self._done:
            raise InvalidInput(f"page {key!r} is already stored; take it before storing it again")
        with self._lock:
            self._done[key] = threading.Event()
        self._queue.put((key, value))

    def take(self, key: str) -> Any:
        """Page ``key`` back in: wait for its write, verify its checksum, delete the file."""
        event = self._done.get(key)
        if event is None:
            raise InvalidInput(f"no page {key!r} was stored")
        event.wait()
        self._raise_pending()
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise CorruptFile(
                f"page file {path} is missing; the paging directory was changed"
            ) from exc
        if hashlib.sha256(data).hexdigest() != self._checksums[key]:
            raise CorruptFile(f"page file {path} fails its checksum; the storage corrupted it")
        value = torch.load(io.BytesIO(data), weights_only=True)
        path.unlink(missing_ok=True)
        with self._lock:
            del self._done[key], self._checksums[key]
        return value

    def flush(self) -> None:
        """Wait until every page handed to :meth:`put` is on disk."""
        for event in list(self._done.values()):
            event.wait()
        self._raise_pending()

    def close(self) -> None:
        """Stop the writer and delete the pages not taken."""
        self._queue.put(None)
        self._thread.join()
        for key in list(self._done):
            self._path(key).unlink(missing_ok=True)
        self._done.clear()
        self._checksums.clear()

    def __enter__(self) -> PageStore:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the writer thread -------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        safe = hashlib.sha1(key.encode()).hexdigest()[:16]
        return self.directory / f"{_PREFIX}{safe}"

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, value = item
            del item
            try:
                if self._error is None:
                    buffer = io.BytesIO()
                    torch.save(value, buffer)
                    del value  # the page is serialised: the tensor may go
                    data = buffer.getvalue()
                    del buffer
                    with self._lock:
                        self._checksums[key] = hashlib.sha256(data).hexdigest()
                    atomic_write_bytes(self._path(key), data, sync_directory=False)
                    self.bytes_written += len(data)
                    del data
            except OSError as exc:
                self._error = exc
            finally:
                value = None
                self._done[key].set()

    def _raise_pending(self) -> None:
        error: Any = self._error
        if error is not None:
            reason = getattr(error, "strerror", None) or str(error)
            raise InvalidInput(
                f"cannot write a page to {self.directory}: {reason}; "
                "name a writable paging directory with free space"
            )
