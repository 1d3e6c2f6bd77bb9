"""Figure 1's claim table at 500², batch 8: the least memory within ρ 1.6 of LinearResNet-101 and
-152, against fixed values. Revolve's are an exhaustive search over its knob (every slot count,
simulated); the optimal plan's are its frontier's, each plan simulated within ρ 1.6, far below
Revolve's (the recompute-factor search returning storing everything gives 7-11 GB)."""

from __future__ import annotations

import pytest

from edgetrain.core.simulator import simulate
from edgetrain.paper.figure1 import CLAIM_RHO, curve
from edgetrain.paper.linear_resnet import linear_resnet_chain
from edgetrain.planners import plan
from edgetrain.planners.revolve import revolve

# ResNet-x's parameters and layer outputs at 500², batch 8 (float32), as model_chain sizes them.
RESNETS = {101: (178_196_640, 7_721_987_328), 152: (240_771_232, 10_855_427_328)}
# Least total memory (4 x weights + activation peak, gradients kept: they are in the 4 x) at
# rho <= 1.6.
REVOLVE = {101: 7_058_578_120, 152: 9_818_828_268}
OPTIMAL = {101: 1_859_616_360, 152: 2_248_596_058}


def revolve_reference(depth: int) -> int:
    weights, activations = RESNETS[depth]
    chain = linear_resnet_chain(depth, weights, activations)
    costs = [
        simulate(chain, revolve(chain, slots), grads_exist=True) for slots in range(1, depth + 1)
    ]
    return 4 * weights + min(c.peak_bytes for c in costs if c.recompute_factor <= CLAIM_RHO + 1e-9)


@pytest.mark.parametrize("depth", sorted(RESNETS))
def test_figure1_claim_table_at_500_batch_8(depth):
    weights, activations = RESNETS[depth]
    assert revolve_reference(depth) == REVOLVE[depth]
    assert (
        curve(depth, 500, 8, "revolve", weights, activations).memory_at(CLAIM_RHO) == REVOLVE[depth]
    )
    optimal = curve(depth, 500, 8, "optimal", weights, activations)
    assert optimal.memory_at(CLAIM_RHO) == OPTIMAL[depth]
    assert len(optimal.points) > 20
    # The plan the recompute search returns is that point, within the factor.
    chain = linear_resnet_chain(depth, weights, activations)
    cost = simulate(
        chain, plan(chain, "optimal", max_recompute=CLAIM_RHO, grads_exist=True), grads_exist=True
    )
    assert cost.recompute_factor <= CLAIM_RHO + 1e-9
    assert 4 * weights + cost.peak_bytes == OPTIMAL[depth]
    assert OPTIMAL[depth] < 0.3 * REVOLVE[depth]
