"""The model registry: every name builds and runs, inputs are checked, user factories load."""

import json
import sys

import pytest
import torch
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.models import (
    MODEL_NAMES,
    MODELS,
    SEQUENTIAL_NAMES,
    build,
    canonical_name,
    check_image,
    load_factory,
    load_model_file,
    sample_input,
)
from edgetrain.models.mobilenetv2 import MobileNetV2
from edgetrain.models.tiny_lm import TinyLM
from edgetrain.models.unet import UNet
from edgetrain.models.vit import ViT


def test_sequential_names_are_the_papers_models_and_build_sequentials():
    assert set(SEQUENTIAL_NAMES) == {*(f"resnet{d}" for d in (18, 34, 50, 101, 152)), "yolov2-16"}
    assert set(SEQUENTIAL_NAMES) < set(MODEL_NAMES)
    for name in ("resnet18", "yolov2-16"):
        assert isinstance(build(name), nn.Sequential)
    for name in ("resnet18-module", "mobilenetv2", "unet", "vit-tiny", "tinylm"):
        assert not isinstance(build(name), nn.Sequential)


@pytest.mark.parametrize(
    ("spelling", "name"),
    [("ResNet_50", "resnet50"), ("resnet-50-module", "resnet50-module"), ("ViT", "vit-tiny"),
     ("UNet", "unet"), ("MobileNet_V2", "mobilenetv2"), ("yolov2", "yolov2-16")],
)  # fmt: skip
def test_canonical_name_accepts_usual_spellings(spelling, name):
    assert canonical_name(spelling) == name


def test_unknown_model_is_one_line_listing_the_names():
    with pytest.raises(InvalidInput, match="unknown model 'resnet19'") as info:
        build("resnet19")
    assert "unet" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("model", "batch", "size"),
    [
        (MobileNetV2(num_classes=7, width=0.25), 2, 32),
        (UNet(classes=3, base=4, depth=3), 2, 16),
        (ViT(image_size=16, patch=4, dim=24, depth=2, heads=2, num_classes=5), 2, 16),
    ],
)
def test_small_image_models_train_one_step(model, batch, size):
    x = torch.randn(batch, 3, size, size)
    out = model(x)
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_tiny_lm_ties_head_to_embedding_and_sums_both_gradients():
    torch.manual_seed(0)
    model = TinyLM(vocab=50, context=16, dim=16, depth=1, heads=2).double()
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
    tokens = torch.randint(0, 50, (2, 9))
    model(tokens).square().sum().backward()
    tied_grad = model.embed.weight.grad.clone()
    # Untie into a copy: the tied gradient is the sum of the embedding's and the head's.
    untied = TinyLM(vocab=50, context=16, dim=16, depth=1, heads=2).double()
    untied.load_state_dict(model.state_dict())
    untied.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    untied(tokens).square().sum().backward()
    torch.testing.assert_close(tied_grad, untied.embed.weight.grad + untied.head.weight.grad)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_sample_input_fits_every_registered_model_on_meta(name):
    info = MODELS[name]
    size = 64 if info.input == "image" else 8
    with torch.device("meta"):
        model = build(name, image=size) if name == "vit-tiny" else build(name)
        x = sample_input(name, 2, size).to("meta")
        out = model(x)
    assert out.shape[0] == 2


def test_check_image_names_the_size_rule():
    with pytest.raises(InvalidInput, match="multiple of 16"):
        check_image("unet", 40)
    with pytest.raises(InvalidInput, match="at least 33"):
        check_image("resnet50-module", 32, batch=1)
    with pytest.raises(InvalidInput, match="sequence length 300 is too long"):
        check_image("tinylm", 300)
    check_image("unet", 48)
    check_image("tinylm", 256)


FACTORY = """
import torch.nn as nn

def build():
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh())

def not_a_model():
    return 42

def raises():
    return 1 / 0
"""


def test_load_factory_builds_the_users_model(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(FACTORY)
    model = load_factory(f"{path}:build")
    assert isinstance(model, nn.Sequential) and model(torch.randn(2, 4)).shape == (2, 3)


def test_a_model_file_imports_the_modules_beside_it(tmp_path):
    (tmp_path / "edgetrain_test_layers.py").write_text(
        "import torch.nn as nn\n\ndef block():\n    return nn.Linear(4, 3)\n"
    )
    (tmp_path / "net.py").write_text(
        "import torch\nfrom edgetrain_test_layers import block\n\n"
        "def build():\n    return block(), torch.randn(2, 4)\n"
    )
    user = load_model_file(f"{tmp_path}/net.py:build")
    assert isinstance(user.model, nn.Linear) and user.example_input.shape == (2, 4)
    assert str(tmp_path) not in sys.path


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{dir}/missing.py:build", "does not exist"),
        ("{dir}/my_model.py:make", "has no function 'make'"),
        ("{dir}/my_model.py:not_a_model", "returned int, not an nn.Module"),
        ("{dir}/my_model.py", "is not FILE.py:FUNCTION"),
        ("{dir}/broken.py:build", "importing .* failed: SyntaxError"),
        ("{dir}/my_model.py:raises", "raised ZeroDivisionError: division by zero"),
    ],
)
def test_load_factory_mistakes_are_one_line(tmp_path, spec, message):
    (tmp_path / "my_model.py").write_text(FACTORY)
    (tmp_path / "broken.py").write_text("def build(:\n")
    with pytest.raises(InvalidInput, match=message) as info:
        load_factory(spec.format(dir=tmp_path))
    assert "\n" not in str(info.value)


def test_models_command_lists_every_registered_model():
    from click.testing import CliRunner

    from edgetrain.cli.main import cli

    result = CliRunner().invoke(cli, ["models", "--json"], catch_exceptions=False)
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == list(MODEL_NAMES)
    assert {r["name"] for r in rows if r["sequential"]} == set(SEQUENTIAL_NAMES)
    text = CliRunner().invoke(cli, ["models"], catch_exceptions=False).output
    assert "tinylm" in text and "load_factory" in text
