"""PageStore: tensors paged out to files in a directory (the "SD card") and back, safely.

The store :class:`~edgetrain.runtime.checkpointed.Checkpointed` pages activations to (``Po``/``Pi``
operations):

* :meth:`PageStore.put` hands a tensor (or a tuple, list or dict of them) to a background writer
  thread and returns at once, so the write overlaps compute. The writer copies each tensor's
  bytes straight from its storage into a temporary file (no serialisation, no intermediate
  buffer), computes their CRC-32 on the way, drops the tensors as soon as the kernel has the
  bytes (:meth:`wait_written`: what the executor waits for before it counts the memory as
  freed), then fsyncs the file and renames it into place (a crash leaves no half-written page
  under a page's name);
* :meth:`PageStore.take` waits for the page to be on disk, reads it back straight into new
  tensors of the recorded dtype, shape and strides, checks the size and the CRC-32, and deletes
  the file: a page is used once. :meth:`prefetch` asks the kernel to start reading a page ahead
  of its use (``posix_fadvise(WILLNEED)``: no memory of this process is used until the read).
  Nothing is unpickled: the structure of a page (its tree of tuples, lists, dicts and non-tensor
  values) never leaves this process; the file holds raw tensor bytes only.
* a write that finds the disk full (``ENOSPC``, ``EDQUOT``, ``EFBIG``) is retried, with waits
  growing from 50 ms to 1 s, until there is room again or :data:`DISK_FULL_RETRY_SECONDS` have
  passed; the wait and the recovery are each one :func:`edgetrain.progress.note` line. Any other
  failed write, or a disk still full then, is reported by the next call as one line
  (:class:`~edgetrain.errors.InvalidInput`) and fails that step only: :meth:`clear` (what the
  executor calls when a step begins and ends) forgets the failure with the step's pages, so the
  next step pages afresh. A missing, truncated or corrupted page file is
  :class:`~edgetrain.errors.CorruptFile`. :meth:`close` removes whatever pages are left.

The checksum is CRC-32 (``zlib.crc32``, 0.75 ms per MiB here against 2.7 ms for SHA-256): it
guards against what storage does to data (flipped bits, torn or truncated writes: a CRC detects
every burst of up to 32 bits and any other damage with probability 1 - 2^-32), and the file's
size is checked as well; pages live for one training step in a directory the user controls, so
there is no adversary to defend against.

The directory is the user's, and may be shared: every page file is named
``edgetrain-page-<pid>-<token>-<n>`` (the process id, 8 random hex digits drawn when the store is
made, and a count of the pages it has written), so two processes, two stores in one process or
two steps never use one name, and a store reads, renames and removes only its own files (and
their temporary ``.edgetrain-page-*.tmp`` twins). Pages a killed process left behind carry its
process id and are never read; they may be deleted once that process is gone.
"""

from __future__ import annotations

import errno
import itertools
import os
import queue
import secrets
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from edgetrain import progress
from edgetrain.errors import CorruptFile, InvalidInput

_PREFIX = "edgetrain-page-"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
DISK_FULL_RETRY_SECONDS = 30.0
"""How long a page write waits for room on a full disk before its step fails."""


@dataclass
class _Page:
    """What the store keeps in memory about one page: its structure and how to check it."""

    spec: Any
    leaves: list[Any]  # non-tensor leaves as they are; tensor leaves as (dtype, size, stride)
    tensor_at: list[int]  # positions of the tensor leaves
    nbytes: int
    path: Path
    written: threading.Event = field(default_factory=threading.Event)
    durable: threading.Event = field(default_factory=threading.Event)
    checksum: int = 0
    prefetched: bool = False


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor, or a contiguous copy when its elements do not fill one span of storage."""
    if tensor.is_contiguous() or (
        tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last)
    ):
        return tensor
    return tensor.contiguous()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a dense tensor's elements, as a view of its storage (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    start = tensor.storage_offset() * tensor.element_size()
    return memoryview(flat.numpy())[start : start + tensor.numel() * tensor.element_size()]


def _write_all(fd: int, tensors: list[torch.Tensor]) -> int:
    """Write the dense tensors' bytes to ``fd`` in order; returns the CRC-32 of everything
    written. The caller empties the list once the kernel has all the bytes (a write that finds
    the disk full starts again from the first tensor)."""
    checksum = 0
    for tensor in tensors:
        view = _bytes_of(tensor)
        checksum = zlib.crc32(view, checksum)
        while view:
            view = view[os.write(fd, view) :]
        del view
    return checksum


class PageStore:
    """Pages of tensors in ``directory``, written by one background thread.

    Use as a context manager, or call :meth:`close`. Keys are any strings unique among the pages
    alive at once.
    """

    def __init__(self, directory: str | Path, *, retry_seconds: float | None = None) -> None:
        """``retry_seconds``: how long a write waits for room on a full disk (default
        :data:`DISK_FULL_RETRY_SECONDS`)."""
        path = Path(directory)
        if not path.is_dir():
            raise InvalidInput(f"paging directory {path} does not exist; create it or name another")
        if not os.access(path, os.W_OK):
            raise InvalidInput(f"cannot write to paging directory {path}; name a writable one")
        self.directory = path
        self.retry_seconds = DISK_FULL_RETRY_SECONDS if retry_seconds is None else retry_seconds
        self.bytes_written = 0
        self.disk_full_waits = 0  # writes that found the disk full and waited for room
        self._name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self._serial = itertools.count()
        self._notes: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._queue: queue.Queue[tuple[str, _Page, list[torch.Tensor]] | None] = queue.Queue()
        self._pages: dict[str, _Page] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._syncs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        # Two threads, so that a page's write never waits behind the fsync of the one before.
        self._threads = [
            threading.Thread(target=self._write_loop, name="edgetrain-pager", daemon=True),
            threading.Thread(target=self._sync_loop, name="edgetrain-pager-sync", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- public ------------------------------------------------------------------------------------

    def put(self, key: str, value: Any) -> None:
        """Page ``value`` (tensors, detached) out under ``key``; returns before the write ends."""
        self._raise_pending()
        if key in self._pages:
            raise InvalidInput(f"page {key!r} is already stored; take it before storing it again")
        leaves, spec = tree_flatten(value)
        tensors: list[torch.Tensor] = []
        at: list[int] = []
        kept: list[Any] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                tensor = _dense(leaf.detach().cpu())
                tensors.append(tensor)
                at.append(i)
                kept.append((tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())))
            else:
                kept.append(leaf)
        del leaves, value
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        page = _Page(spec, kept, at, nbytes, self.directory / f"{self._name}{next(self._serial)}")
        self._pages[key] = page
        self._queue.put((key, page, tensors))

    def wait_written(self, key: str) -> None:
        """Wait until the kernel has page ``key``'s bytes and the store has dropped its tensors
        (the page is not yet durable: :meth:`take` waits for that)."""
        page = self._pages.get(key)
        if page is not None:
            self._wait(page.written)
        self._raise_pending()

    def prefetch(self, key: str) -> None:
        """Ask the kernel to read page ``key`` ahead of :meth:`take`, if it is on disk already."""
        page = self._pages.get(key)
        if page is None or page.prefetched or not page.durable.is_set() or self._error:
            return
        page.prefetched = True
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        try:
            fd = os.open(page.path, os.O_RDONLY)
        except OSError:
            return  # take() reports it
        try:
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    def take(self, key: str) -> Any:
        """Page ``key`` back in: wait for its write, verify size and checksum, delete the file."""
        page = self._pages.get(key)
        if page is None:
            raise InvalidInput(f"no page {key!r} was stored")
        self._wait(page.durable)
        self._raise_pending()
        path = page.path
        leaves = list(page.leaves)
        checksum = 0
        try:
            with open(path, "rb", buffering=0) as handle:
                if os.fstat(handle.fileno()).st_size != page.nbytes:
                    raise CorruptFile(
                        f"page file {path} has the wrong size; the storage truncated or changed it"
                    )
                for i in page.tensor_at:
                    dtype, size, stride = page.leaves[i]
                    tensor = torch.empty_strided(size, stride, dtype=dtype)
                    view = _bytes_of(tensor)
                    if handle.readinto(view) != len(view):
                        raise CorruptFile(f"page file {path} is truncated; the storage changed it")
                    checksum = zlib.crc32(view, checksum)
                    leaves[i] = tensor
        except FileNotFoundError as exc:
            raise CorruptFile(
                f"page file {path} is missing; the paging directory was changed"
            ) from exc
        if checksum != page.checksum:
            raise CorruptFile(f"page file {path} fails its checksum; the storage corrupted it")
        # Deleting can take milliseconds (a discard on some filesystems): the sync thread does it.
        self._syncs.put(lambda: path.unlink(missing_ok=True))
        del self._pages[key]
        return tree_unflatten(leaves, page.spec)

    def flush(self) -> None:
        """Wait until every page handed to :meth:`put` is on disk and every page taken is
        deleted."""
        for page in list(self._pages.values()):
            self._wait(page.durable)
        self._syncs.join()
        self._raise_pending()

    def clear(self) -> None:
        """Finish every write and deletion under way and delete the pages not taken (the end of
        a training step); the store stays usable. Never raises."""
        if self._closed:
            return
        self._queue.join()
        self._syncs.join()
        for page in self._pages.values():
            page.path.unlink(missing_ok=True)
        self._pages.clear()
        self._error = None  # the failed step's pages are gone: the next step pages afresh
        self._show_notes()

    @property
    def failed(self) -> bool:
        """Whether a write of this step failed (the store refuses further work until
        :meth:`clear`)."""
        return self._error is not None

    def close(self) -> None:
        """Delete the pages not taken and stop the threads."""
        if self._closed:
            return
        self.clear()
        self._closed = True
        self._queue.put(None)
        for thread in self._threads:
            thread.join()

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

    def _write_loop(self) -> None:
        """Hand each page's bytes to the kernel, drop its tensors, pass it on to be synced."""
        while True:
            item = self._queue.get()
            if item is None:
                self._syncs.put(None)
                self._queue.task_done()
                return
            _key, page, tensors = item
            del item
            try:
                self._write(page, tensors)
            finally:
                tensors.clear()
                page.written.set()
                self._queue.task_done()

    def _write(self, page: _Page, tensors: list[torch.Tensor]) -> None:
        path = page.path
        tmp = path.with_name(f".{path.name}.tmp")
        if self._error is not None:
            page.durable.set()
            return
        fd = self._write_waiting_for_room(tmp, page, tensors)
        if fd < 0:
            page.durable.set()
            return
        tensors.clear()  # the kernel has the bytes

        def sync() -> None:
            try:
                os.fsync(fd)
                os.close(fd)
                os.replace(tmp, path)
                self.bytes_written += page.nbytes
            except OSError as exc:
                self._error = exc
                tmp.unlink(missing_ok=True)
            finally:
                page.durable.set()

        self._syncs.put(sync)

    def _write_waiting_for_room(self, tmp: Path, page: _Page, tensors: list[torch.Tensor]) -> int:
        """Write the page to ``tmp``; on a full disk wait and write it again until there is room
        or ``retry_seconds`` have passed. The open descriptor, or -1 with ``_error`` set."""
        began = time.monotonic()
        pause = 0.05
        while True:
            fd = -1
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                page.checksum = _write_all(fd, tensors)
            except OSError as exc:
                if fd >= 0:
                    os.close(fd)
                tmp.unlink(missing_ok=True)
                waited = time.monotonic() - began
                if exc.errno not in DISK_FULL or waited + pause > self.retry_seconds:
                    self._error = exc
                    return -1
                if pause == 0.05:  # the first wait of this write
                    self.disk_full_waits += 1
                    self._notes.put(
                        f"paging: {self.directory} is full; waiting up to "
                        f"{self.retry_seconds:g} s for room to write a page"
                    )
                time.sleep(pause)
                pause = min(1.0, 2 * pause)
                continue
            if pause > 0.05:
                self._notes.put(
                    f"paging: room again in {self.directory}; the page was written after "
                    f"{time.monotonic() - began:.1f} s and the step goes on"
                )
            return fd

    def _wait(self, event: threading.Event) -> None:
        """Wait for ``event``, showing the writer's notes (a full disk) as they come."""
        while not event.wait(0.25):
            self._show_notes()
        self._show_notes()

    def _show_notes(self) -> None:
        """Print the writer thread's notes from this thread (progress is not thread-safe)."""
        while True:
            try:
                text = self._notes.get_nowait()
            except queue.Empty:
                return
            progress.note(text)

    def _sync_loop(self) -> None:
        """fsync written pages, rename them into place, delete pages taken: in order."""
        while True:
            task = self._syncs.get()
            try:
                if task is None:
                    return
                task()
            finally:
                self._syncs.task_done()

    def _raise_pending(self) -> None:
        self._show_notes()
        error: Any = self._error
        if error is not None and getattr(error, "errno", None) in DISK_FULL:
            raise InvalidInput(
                f"no room to write a page to {self.directory} ({error.strerror}; a write waits "
                f"up to {self.retry_seconds:g} s for room); free space there or name another "
                "paging directory (the next step tries again)"
            )
        if error is not None:
            reason = getattr(error, "strerror", None) or str(error)
            raise InvalidInput(
                f"cannot write a page to {self.directory}: {reason}; "
                "name a writable paging directory with free space"
            )
