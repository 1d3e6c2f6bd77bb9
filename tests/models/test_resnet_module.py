"""The torchvision-layout ResNets equal the Sequential ResNets: same parameters, same outputs."""

import pytest
import torch

from edgetrain.models import build
from edgetrain.models.resnet_module import module_key, module_state


@pytest.fixture(autouse=True)
def one_thread():
    """Full-width ResNets in float64: one thread is faster than two on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("depth", [18, 50])
def test_same_seed_gives_the_same_parameters_under_the_name_mapping(depth):
    torch.manual_seed(3)
    sequential = build(f"resnet{depth}")
    torch.manual_seed(3)
    module = build(f"resnet{depth}-module")
    mapped = module_state(sequential.state_dict())
    target = module.state_dict()
    assert sorted(mapped) == sorted(target)
    for key, value in mapped.items():
        assert torch.equal(value, target[key]), key


@pytest.mark.parametrize("depth", [18, 50, 101, 152])
def test_loading_one_into_the_other_gives_bitwise_equal_outputs_and_statistics(depth):
    torch.manual_seed(0)
    sequential = build(f"resnet{depth}").double()
    torch.manual_seed(1)  # different weights, overwritten by the load
    module = build(f"resnet{depth}-module").double()
    module.load_state_dict(module_state(sequential.state_dict()), strict=True)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    out_sequential, out_module = sequential(x), module(x)
    assert torch.equal(out_sequential, out_module)
    out_sequential.square().sum().backward()
    out_module.square().sum().backward()
    grads = dict(module.named_parameters())
    for name, parameter in sequential.named_parameters():
        assert torch.equal(parameter.grad, grads[module_key(name)].grad), name
    buffers = dict(module.named_buffers())
    for name, buffer in sequential.named_buffers():
        assert torch.equal(buffer, buffers[module_key(name)]), name


def test_module_form_is_not_a_sequential_and_uses_torchvision_names():
    model = build("resnet18-module")
    assert not isinstance(model, torch.nn.Sequential)
    names = [name for name, _ in model.named_children()]
    assert names == [
        "conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"
    ]  # fmt: skip
