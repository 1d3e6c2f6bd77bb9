"""Profiling: measured and analytic chains agree on every byte; stages group as they must."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.errors import InvalidInput
from edgetrain.frontend.profiling import analytic_chain, profile_chain
from edgetrain.models import build, model_chain
from edgetrain.runtime.checkpointed import Checkpointed
from tests.conftest import small_cnn
from tests.helpers import same_state

BYTE_FIELDS = [
    f.name
    for f in dataclasses.fields(__import__("edgetrain.core.chain", fromlist=["Stage"]).Stage)
    if f.name.endswith("_bytes") and not f.name.endswith("_scratch_bytes")
]
"""The tensor byte counts; kernel scratch is the device's own (its kernels), measured only there."""


@pytest.mark.parametrize("requires_grad", [False, True])
def test_measured_chain_equals_analytic_chain_on_every_byte_count(requires_grad):
    model = small_cnn(torch.float32)
    x = torch.randn(4, 3, 8, 8, requires_grad=requires_grad)
    measured = profile_chain(model, x, repeats=2)
    analytic = analytic_chain(model, x)
    assert [s.name for s in measured] == [s.name for s in analytic]
    for a, b in zip(measured.stages, analytic.stages, strict=True):
        for field in [*BYTE_FIELDS, "saves_input", "span"]:
            assert getattr(a, field) == getattr(b, field), (a.name, field)
        assert a.forward_seconds > 0 and a.backward_seconds > 0
    assert measured.input_requires_grad == requires_grad


def test_resnet_measured_chain_equals_its_analytic_chain():
    model = build("resnet18")
    x = torch.randn(2, 3, 64, 64)
    measured = profile_chain(model, x, repeats=1)
    analytic = analytic_chain(model, x)
    for a, b in zip(measured.stages, analytic.stages, strict=True):
        assert [getattr(a, f) for f in BYTE_FIELDS] == [getattr(b, f) for f in BYTE_FIELDS]


def test_in_place_and_view_children_join_the_stage_before():
    chain = analytic_chain(small_cnn(), torch.randn(2, 3, 8, 8, dtype=torch.float64))
    names = [s.name for s in chain.stages]
    assert "1+2" in names  # BatchNorm + ReLU(inplace=True)
    assert "11+12" in names  # Scale + Flatten (a view)
    assert sum(s.span for s in chain.stages) == len(small_cnn())


def test_a_view_as_first_child_joins_the_next():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.ReLU())
    chain = analytic_chain(model, torch.randn(2, 3, 2, 2))
    assert [s.name for s in chain.stages] == ["0+1", "2"]


def test_profiling_leaves_the_model_as_it_was():
    model = small_cnn(torch.float32)
    x = torch.randn(4, 3, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    profile_chain(model, x, repeats=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_model_chain_uses_meta_tensors_for_huge_inputs():
    chain = model_chain("resnet152", 50, 1500, timing=False)  # 25 GB if it were real
    assert chain.layer_output_bytes > 20 * 2**30


@pytest.mark.parametrize(
    ("model", "shape", "message"),
    [
        (nn.Linear(3, 3), (2, 3), "nn.Sequential"),
        (nn.Sequential(), (2, 3), "no children"),
        (nn.Sequential(nn.Linear(3, 4), nn.Linear(5, 2)), (2, 3), "sizes and dtypes chain"),
        (nn.Sequential(nn.Linear(3, 4).double()), (2, 3), "sizes and dtypes chain"),
        (nn.Sequential(nn.ReLU(inplace=True), nn.Linear(3, 2)), (2, 3), "inplace=False"),
    ],
)
def test_bad_models_get_one_line_errors(model, shape, message):
    with pytest.raises(InvalidInput, match=message) as info:
        profile_chain(model, torch.randn(*shape), repeats=1)
    assert "\n" not in str(info.value)


def test_bad_model_arguments():
    with pytest.raises(InvalidInput, match="unknown model"):
        model_chain("resnet19", 1, 224)
    with pytest.raises(InvalidInput, match="batch must be at least 1"):
        model_chain("resnet18", 0, 224)
    with pytest.raises(InvalidInput, match="too small"):
        model_chain("yolov2-16", 1, 8)


class MaskedLayers(nn.Module):
    """Adds a float mask made from integer ids (it needs no gradient) in every layer, as a
    transformer adds its attention mask: the mask is carried through the stages beside the
    activations, which do need one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        bias = torch.where(ids[..., None] > 0, 0.0, -1e9).to(x.dtype)
        for layer in self.layers:
            x = torch.tanh(layer(x) + bias)
        return x


def test_a_float_tensor_made_from_ids_gets_no_gradient_and_the_peak_is_as_predicted():
    torch.manual_seed(0)
    model = MaskedLayers().double()
    inputs = {"x": torch.randn(4, 6, 8, dtype=torch.float64), "ids": torch.randint(0, 3, (4, 6))}
    chain = analytic_chain(model, inputs)
    carrying = [k for k in range(1, chain.length) if chain.tensors_needing_grad(k) is not None]
    assert carrying  # the mask beside the activation: the activation's gradient only
    assert all(chain.gradient_of_activation_bytes(k) == 4 * 6 * 8 * 8 for k in carrying)
    assert chain == type(chain).from_json(chain.to_json())
    ours, plain = copy.deepcopy(model), copy.deepcopy(model)
    net = Checkpointed(ours, inputs, chain=chain, memory_budget="min")
    counter = StorageCounter()
    with counter:
        out = net(**inputs)
        out.backward(torch.ones_like(out))
        del out
    out = plain(**inputs)
    out.backward(torch.ones_like(out))
    same_state(ours, plain)
    assert counter.peak_bytes == net.cost.peak_bytes
