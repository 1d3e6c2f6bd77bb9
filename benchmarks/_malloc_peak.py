"""Peak heap memory of a call, seen by glibc: ``mallinfo2`` sampled by a thread.

Every CPU tensor, eager or allocated inside ``torch.compile``'d code, comes from glibc's
malloc, so this sees what a ``TorchDispatchMode`` (``StorageCounter``) cannot: buffers that
compiled kernels allocate. In use = ``uordblks`` (main-arena chunks in use) + ``hblkhd``
(mmapped chunks: every large tensor). A sampling thread spins on ``mallinfo2`` while the call
runs (torch kernels release the GIL, so it samples inside them); a peak shorter than one sample
can be missed, so the figure is a lower bound that ``StorageCounter`` confirms on eager code.
Also counted: scratch buffers of kernels and the allocator's own bookkeeping. Linux/glibc only.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_in_use() -> int:
    """Bytes glibc has handed out and not taken back (main arena + mmapped chunks)."""
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def malloc_peak(call: Callable[[], object]) -> int:
    """Most heap bytes in use during ``call()`` above what was in use when it started."""
    base = heap_in_use()
    seen = [base]
    done = threading.Event()

    def sample() -> None:
        peak = base
        while not done.is_set():
            peak = max(peak, heap_in_use())
        seen.append(peak)

    sampler = threading.Thread(target=sample, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # let the sampler in between Python-level operations too
    sampler.start()
    try:
        call()
        seen.append(heap_in_use())
    finally:
        done.set()
        sampler.join()
        sys.setswitchinterval(interval)
    return max(seen) - base


def release_free_memory() -> None:
    """Hand free heap memory back to the system (``malloc_trim``): fewer free chunks for
    ``mallinfo2`` to walk, which it does holding the allocator's lock."""
    _libc.malloc_trim(0)
