"""The process heap's peak during a block, as glibc sees it (``mallinfo2``), sampled by a thread.

Every CPU tensor comes from glibc's malloc, and so does the scratch memory kernels allocate for
themselves and free before they return (convolution workspaces), which never becomes a tensor
and which :class:`~edgetrain.autograd.storage_counter.StorageCounter` therefore does not see. In
use = main-arena
chunks in use (``uordblks``) + mmapped chunks (``hblkhd``: every large tensor). A thread spins on
``mallinfo2`` while the block runs (torch kernels release the GIL, so it samples inside them); a
peak shorter than one sample can be missed: a lower bound. Linux with glibc only: elsewhere
:attr:`HeapPeak.peak_bytes` stays None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from types import TracebackType


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _mallinfo2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def heap_in_use() -> int | None:
    """Bytes glibc has handed out and not taken back (None without glibc's ``mallinfo2``)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class HeapPeak:
    """``with HeapPeak() as heap: ...``; then ``heap.peak_bytes``: the most heap in use during
    the block above what was in use when it started (None without glibc)."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._base = 0
        self._peak = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._interval = sys.getswitchinterval()

    def _sample(self) -> None:
        while not self._done.is_set():
            self._peak = max(self._peak, heap_in_use() or 0)

    def __enter__(self) -> HeapPeak:
        base = heap_in_use()
        if base is None:
            return self
        self._base = self._peak = base
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # let the sampler in between Python-level operations too
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._thread is None:
            return
        self._peak = max(self._peak, heap_in_use() or 0)
        self._done.set()
        self._thread.join()
        sys.setswitchinterval(self._interval)
        self.peak_bytes = self._peak - self._base
