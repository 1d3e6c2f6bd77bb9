"""A chain that starts with stages needing no backward (a frozen backbone before the first
trainable parameter: they save nothing, make no gradient, cost no backward time): the planner
is never slower, at any memory, than running them once, holding their output and planning the
rest on it; it runs them again only where that saves memory."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from edgetrain.core.chain import Chain, Stage
from edgetrain.core.schedule import Op, Schedule
from edgetrain.core.simulator import simulate
from edgetrain.planners.search import frontier
from tests.conftest import random_chain


def frozen_stage(rng: random.Random, k: int) -> Stage:
    out = rng.randint(1, 40)
    peak = out + rng.randint(0, 20)
    return Stage(
        name=f"frozen{k}",
        output_bytes=out,
        saved_bytes=0,
        saves_input=False,
        forward_peak_bytes=peak,
        forward_grad_peak_bytes=peak,
        backward_peak_bytes=0,
        weight_bytes=rng.randint(0, 10),
        gradient_bytes=0,
        forward_seconds=rng.uniform(0.5, 2.0),
        backward_seconds=0.0,
        output_requires_grad=False,
    )


def run_once(chain: Chain, prefix: int, rest: Schedule) -> Schedule:
    """The stages needing no backward run once as graphs (which hold nothing), then ``rest``."""
    ops = [(Op.FORWARD_ALL, k) for k in range(prefix)]
    ops += [(op, k + prefix) for op, k in rest]
    ops += [(Op.BACKWARD, k) for k in reversed(range(prefix))]
    return Schedule.from_ops(chain.length, ops)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), prefix=st.integers(1, 3), length=st.integers(1, 5))
def test_the_planner_is_never_slower_than_running_a_frozen_prefix_once(seed, prefix, length):
    rng = random.Random(seed)
    rest = random_chain(rng, length)
    frozen = tuple(frozen_stage(rng, k) for k in range(prefix))
    chain = Chain(frozen + rest.stages, input_bytes=rng.randint(1, 40))
    assert not any(chain.requires_grad(k) for k in range(prefix + 1))
    ours = frontier(chain).points
    held_rest = Chain(rest.stages, chain.activation_bytes(prefix), False)
    for point in frontier(held_rest).points:
        cost = simulate(chain, run_once(chain, prefix, point.schedule))
        fastest = min(p.seconds for p in ours if p.peak_bytes <= cost.peak_bytes)
        assert fastest <= cost.seconds * (1 + 1e-9)
    # Storing everything runs each stage once; its time has no backward for the prefix.
    plain = simulate(chain, run_once(chain, prefix, frontier(held_rest).points[-1].schedule))
    assert ours[-1].seconds <= plain.seconds * (1 + 1e-9)
    assert chain.backward_seconds == rest.backward_seconds
