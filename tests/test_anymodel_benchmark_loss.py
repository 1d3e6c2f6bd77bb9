"""The any-model benchmark's planning chain (``benchmarks/anymodel.py``: the caller's loss merged
into the chain's last stage) predicts the whole training step's peak, loss included, as
``StorageCounter`` measures it: on a language model whose logits and loss dominate memory and on
a CNN whose output is small, for plans from the least memory to storing everything (to within
128 bytes: a few scalars)."""

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from edgetrain.measure import StorageCounter
from edgetrain.models.mobilenetv2 import MobileNetV2
from edgetrain.models.tiny_lm import TinyLM
from edgetrain.planners.optimal import store_all
from edgetrain.schedule import simulate

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "anymodel.py"


@pytest.fixture(scope="module")
def anymodel():
    spec = importlib.util.spec_from_file_location("anymodel_under_test", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


CASES = [
    (
        "tinylm",
        lambda: TinyLM(vocab=2048, context=32, dim=32, depth=2, heads=2),
        lambda: torch.randint(0, 2048, (4, 32)),
    ),
    ("mobilenetv2", lambda: MobileNetV2(10, width=0.35), lambda: torch.randn(2, 3, 32, 32)),
]


@pytest.mark.parametrize(("name", "make", "make_input"), CASES, ids=[c[0] for c in CASES])
def test_step_peak_with_the_loss_is_predicted_exactly(anymodel, name, make, make_input):
    torch.manual_seed(0)
    model, x = make(), make_input()
    edgetrain = anymodel.Edgetrain(model, x)
    least = edgetrain.least_bytes()
    most = simulate(edgetrain.planning, store_all(edgetrain.planning)).peak_bytes
    assert least < most
    for budget in (least, (least + most) // 2, most):
        net = edgetrain.net(budget)
        predicted = edgetrain.predicted(net).peak_bytes
        assert predicted <= budget
        step = anymodel._training_step(net, list(net.module.parameters()), x)
        step()  # warm-up, as the benchmark does
        counter = StorageCounter()
        with counter:
            step()
        # Exact but for a few scalars (the chain's own prediction is off by 8 bytes on the
        # least plan of this MobileNetV2 too): 128 bytes.
        assert abs(counter.peak_bytes - predicted) <= 128, (name, budget)


def test_loss_is_not_counted_twice_nor_at_the_chains_peak(anymodel):
    """On a language model the loss (the logits' square, the gradients of the mean and the
    square: four logits-sized tensors with the output's gradient) sits on top of what the plan
    holds when the forward ends. The least plan's step is then below the chain's least peak plus
    everything the loss holds, the sum the benchmark used to plan for."""
    torch.manual_seed(0)
    model = TinyLM(vocab=2048, context=32, dim=32, depth=2, heads=2)
    x = torch.randint(0, 2048, (4, 32))
    edgetrain = anymodel.Edgetrain(copy.deepcopy(model), x)
    net = edgetrain.net(edgetrain.least_bytes())
    leaf = torch.zeros(4, 32, 2048, requires_grad=True)
    counter = StorageCounter()
    with counter:
        anymodel._loss(leaf).backward()
    step = anymodel._training_step(net, list(net.module.parameters()), x)
    step()
    measured = StorageCounter()
    with measured:
        step()
    assert measured.peak_bytes < net.cost.peak_bytes + counter.peak_bytes
