"""What ``torch.utils.checkpoint.checkpoint_sequential(model, segments, x)`` does, as a Schedule.

PyTorch cuts the ``L`` stages into ``segments`` pieces of ``L // segments`` stages; every piece but
the last runs without grad, keeping only its input, and is recomputed with grad when the backward
reaches it; the last piece (which takes the remainder) runs normally. On ``l`` equal stages it keeps
``s - 1 + (l - ⌊l/s⌋(s - 1))`` activations, never fewer than about ``2·sqrt(l)`` (paper §V).
"""

from __future__ import annotations

from edgetrain.core.chain import Chain
from edgetrain.core.schedule import Op, Schedule
from edgetrain.errors import InvalidInput


def segment_bounds(length: int, segments: int) -> list[tuple[int, int]]:
    """The stage ranges ``(first, last)`` (inclusive) of the checkpointed segments."""
    if not 1 <= segments <= length:
        raise InvalidInput(
            f"segments must be between 1 and the number of stages ({length}), got {segments}"
        )
    size = length // segments
    return [(start, start + size - 1) for start in range(0, size * (segments - 1), size)]


def sequential(chain: Chain, segments: int) -> Schedule:
    """The schedule of ``checkpoint_sequential`` with ``segments`` segments on ``chain``."""
    n = chain.length
    bounds = segment_bounds(n, segments)
    tail = bounds[-1][1] + 1 if bounds else 0
    ops: list[tuple[Op, int]] = []
    for first, last in bounds:
        ops.append((Op.FORWARD_CHECKPOINT, first))
        ops.extend((Op.FORWARD_NOSAVE, k) for k in range(first + 1, last + 1))
    ops.extend((Op.FORWARD_ALL, k) for k in range(tail, n))
    ops.extend((Op.BACKWARD, k) for k in range(n - 1, tail - 1, -1))
    for first, last in reversed(bounds):
        ops.extend((Op.FORWARD_ALL, k) for k in range(first, last + 1))
        # The recomputed a[last+1] is only the graph's business: its backward is done.
        ops.append((Op.DISCARD, last + 1))
        ops.extend((Op.BACKWARD, k) for k in range(last, first - 1, -1))
    return Schedule.from_ops(n, ops, "sequential", {"segments": segments})
