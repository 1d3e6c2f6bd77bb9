"""Check a tiled run against one process: same model, weights, data and steps (torch).

The tiled output is assembled from the ranks' tiles; the input gradient is the sum of every
rank's gradient over its input region (overlapping halos add up, as they do in the single-process
graph); weight gradients and the final weights and batch-norm statistics come from rank 0 (all
ranks hold the same after the all-reduce, which the per-rank checksums confirm).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np

from edgetrain.tiles.comm import Comm
from edgetrain.tiles.worker import RankResult, TileJob, run_job


def reference(job: TileJob) -> RankResult:
    """``job``'s steps on the untiled model in this process (a copy; ``job.model`` is kept)."""
    single = replace(job, model=copy.deepcopy(job.model), reference=True, collect=True, fault=None)
    return run_job(single, Comm.solo())


NOISE_FLOOR = 1e-3
"""Gradients smaller than this fraction of the largest one are rounding noise (see below)."""


def relative_difference(a: np.ndarray, b: np.ndarray, floor: float = 0.0) -> float:
    """``max |a - b| / max(max |b|, floor)``: the largest error relative to the reference's scale.

    ``floor`` keeps a tensor that is pure rounding noise from dividing by almost nothing: the
    gradient of a convolution bias followed by batch norm is zero in exact arithmetic (the norm
    removes any constant), so both runs hold noise of about 1e-17 there.
    """
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {b.shape}")
    scale = max(float(np.max(np.abs(b))) if b.size else 0.0, floor)
    error = float(np.max(np.abs(a - b))) if a.size else 0.0
    return error / scale if scale > 0 else error


def differences(job: TileJob, ranks: list[RankResult], ref: RankResult) -> dict[str, float]:
    """Relative difference of every compared tensor (output, input gradient, each weight
    gradient against at least a thousandth of the largest, each final weight and buffer against
    at least a thousandth of the largest: a bias whose gradient is exactly zero, before a batch
    norm, holds rounding noise in both runs), and
    ``ranks_agree``: the spread of the ranks' weight checksums (0.0 when bit-identical)."""
    assert ref.output is not None and ref.input_grad is not None
    output = np.zeros_like(ref.output)
    input_grad = np.zeros_like(ref.input_grad)
    for r in ranks:
        if r.output is None or r.input_grad is None:
            raise AssertionError("run the job with collect=True")
        o, i = r.output_region, r.input_region
        if output.ndim == 4:  # a tile of the map, or the whole map
            output[:, :, o.top : o.bottom, o.left : o.right] = r.output
        else:  # class scores: the same on every rank
            output = r.output
        input_grad[:, :, i.top : i.bottom, i.left : i.right] += r.input_grad
    out = {
        "output": relative_difference(output, ref.output),
        "input_grad": relative_difference(input_grad, ref.input_grad),
    }
    leader = next(r for r in ranks if r.rank == 0)
    if set(leader.grads) != set(ref.grads):
        raise AssertionError("the tiled run and the reference have different parameters")
    largest = max((float(np.max(np.abs(g))) for g in ref.grads.values() if g.size), default=0.0)
    for name, grad in ref.grads.items():
        out[f"grad:{name}"] = relative_difference(leader.grads[name], grad, NOISE_FLOOR * largest)
    largest_state = max(
        (float(np.max(np.abs(v))) for v in ref.state.values() if v.size), default=0.0
    )
    for name, value in ref.state.items():
        out[f"state:{name}"] = relative_difference(
            leader.state[name], value, NOISE_FLOOR * largest_state
        )
    checksums = [r.checksum for r in ranks]
    out["ranks_agree"] = max(checksums) - min(checksums)  # 0.0: bit-identical weights
    return out


def max_relative_difference(job: TileJob, ranks: list[RankResult], ref: RankResult) -> float:
    """The largest relative difference of outputs, gradients and weights (``max_rel_diff``)."""
    values = differences(job, ranks, ref)
    values.pop("ranks_agree")
    return max(values.values())
