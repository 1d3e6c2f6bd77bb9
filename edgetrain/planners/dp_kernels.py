"""The numpy kernels of the dynamic program's fill (:mod:`edgetrain.planners.dp_table`)."""

from __future__ import annotations

import numpy as np

CHUNK_ELEMENTS = 131072
"""Candidates summed and reduced at a time (1 MiB of float64: they stay in the cache)."""


def least_sum(
    far: np.ndarray,
    near: np.ndarray,
    reached: np.ndarray,
    binding: np.ndarray,
    start: int,
    end: int,
) -> np.ndarray:
    """``min over q of far[q] + near[q]`` over the slots ``start..end-1``, each term inf where
    ``m < reached[q]``: arrays ``[q, row, m]`` and ``reached[q, row]``, in chunks of q that
    stay in the cache. Only the terms ``binding[q, row]`` have finite sums below ``reached``
    (the others are inf there).

    The tables' rows are contiguous: where the slots asked for are most of a row, the sums
    run over whole rows (each chunk one stretch of memory for numpy's loops, several times
    faster a slot than a part of every row) and the slots asked for are taken after."""
    span, rows, size = far.shape
    first_slot, width = (start, end - start) if 2 * (end - start) < size else (0, size)
    far = far[..., first_slot : first_slot + width]
    near = near[..., first_slot : first_slot + width]
    limit = np.clip(reached - first_slot, 0, width)
    chunk = max(1, min(span, CHUNK_ELEMENTS // (rows * width)))
    cand = np.empty((chunk, rows, width))
    least = np.full((rows, width), np.inf)
    part = np.empty((rows, width))
    bound_q, bound_row = np.nonzero(binding)  # q ascending
    for first in range(0, span, chunk):
        last = min(span, first + chunk)
        c = cand[: last - first]
        np.add(far[first:last], near[first:last], out=c)
        lo, hi = np.searchsorted(bound_q, (first, last))
        for q, row in zip(bound_q[lo:hi].tolist(), bound_row[lo:hi].tolist(), strict=True):
            c[q - first, row, : limit[q, row]] = np.inf
        np.minimum.reduce(c, axis=0, out=part)
        np.minimum(least, part, out=least)
    return least[:, start - first_slot : end - first_slot]


def shift_each(values: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """``out[..., m] = values[..., m - offset[...]]`` (inf where ``m < offset``), per row.

    ``offset`` broadcasts against ``values`` without its last axis: what a sub-problem has left
    when ``offset`` slots are held outside it.
    """
    size = values.shape[-1]
    offset = np.broadcast_to(np.asarray(offset, dtype=np.int64), values.shape[:-1])
    index = np.arange(size) - offset[..., None]
    out = np.take_along_axis(values, np.clip(index, 0, size - 1), axis=-1)
    return np.where(index >= 0, out, np.inf)
