"""The registry of models built from code: names, builders, sample inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.models.mobilenetv2 import MobileNetV2
from edgetrain.models.resnet import ARCHITECTURES, resnet
from edgetrain.models.resnet_module import resnet_module
from edgetrain.models.tiny_lm import TinyLM
from edgetrain.models.unet import UNet
from edgetrain.models.vit import ViT
from edgetrain.models.yolov2 import yolov2_16


@dataclass(frozen=True)
class ModelInfo:
    """What a registered model is and what input it takes.

    ``input`` is ``"image"`` (a float batch of square RGB images, side ``size``) or ``"tokens"``
    (a batch of token ids, ``size`` tokens long). ``min_size`` is the smallest side (or length)
    at a batch of 2 or more, ``min_size_batch_1`` at a batch of one (BatchNorm in training needs
    more than one value per channel); the side must be a multiple of ``multiple`` and at most
    ``max_size`` (None: no limit). ``sequential``: :func:`build` returns an ``nn.Sequential`` of
    stages (the chain planners take it as it is).
    """

    name: str
    description: str
    sequential: bool
    input: str = "image"
    min_size: int = 1
    min_size_batch_1: int = 1
    multiple: int = 1
    max_size: int | None = None
    vocab: int = 0


_LM_VOCAB, _LM_CONTEXT = 4096, 256


def _resnets() -> list[ModelInfo]:
    infos = []
    for depth in ARCHITECTURES:
        for suffix, sequential in (("", True), ("-module", False)):
            form = "nn.Sequential of stages" if sequential else "torchvision layout, forward()"
            infos.append(
                ModelInfo(
                    f"resnet{depth}{suffix}",
                    f"ResNet-{depth}, {form}",
                    sequential,
                    min_size=32,
                    min_size_batch_1=33,
                )
            )
    return infos


MODELS: dict[str, ModelInfo] = {
    info.name: info
    for info in [
        *_resnets(),
        ModelInfo(
            "yolov2-16", "YOLOv2 layers 0-15 (Darknet)", True, min_size=16, min_size_batch_1=32
        ),
        ModelInfo(
            "mobilenetv2",
            "MobileNetV2 1.0, inverted residuals",
            False,
            min_size=32,
            min_size_batch_1=33,
        ),
        ModelInfo(
            "unet",
            "U-Net, 4 levels from 16 channels, long skips by concatenation",
            False,
            min_size=16,
            min_size_batch_1=32,
            multiple=16,
        ),
        ModelInfo(
            "vit-tiny",
            "ViT-Tiny/16 encoder (dim 192, 12 blocks, 3 heads), image side fixed at build",
            False,
            min_size=16,
            min_size_batch_1=16,
            multiple=16,
        ),
        ModelInfo(
            "tinylm",
            f"GPT-style LM, 6 causal blocks of 256, vocab {_LM_VOCAB}, head tied to the embedding",
            False,
            input="tokens",
            max_size=_LM_CONTEXT,
            vocab=_LM_VOCAB,
        ),
    ]
}

MODEL_NAMES: tuple[str, ...] = tuple(MODELS)
SEQUENTIAL_NAMES: tuple[str, ...] = tuple(n for n, info in MODELS.items() if info.sequential)

# Kept for callers of the first registry: the smallest square image of each model.
MIN_IMAGE = {n: info.min_size for n, info in MODELS.items() if info.input == "image"}
MIN_IMAGE_BATCH_1 = {
    n: info.min_size_batch_1 for n, info in MODELS.items() if info.input == "image"
}

_ALIASES = {"yolov2": "yolov2-16", "vit": "vit-tiny", "mobilenet-v2": "mobilenetv2"}


def canonical_name(name: str) -> str:
    """The registry spelling of ``name`` ("ResNet_50" -> "resnet50"); InvalidInput if unknown."""
    key = name.strip().lower().replace("_", "-")
    if key.startswith("resnet"):
        key = "resnet" + key.removeprefix("resnet").lstrip("-")
    key = _ALIASES.get(key, key)
    if key not in MODELS:
        raise InvalidInput(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return key


_BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    **{f"resnet{d}": (lambda _, d=d: resnet(d)) for d in ARCHITECTURES},
    **{f"resnet{d}-module": (lambda _, d=d: resnet_module(d)) for d in ARCHITECTURES},
    "yolov2-16": lambda _: yolov2_16(),
    "mobilenetv2": lambda _: MobileNetV2(),
    "unet": lambda _: UNet(),
    "vit-tiny": lambda image: ViT(image_size=image),
    "tinylm": lambda _: TinyLM(vocab=_LM_VOCAB, context=_LM_CONTEXT),
}


def build(name: str, *, image: int = 224) -> nn.Module:
    """Build the model called ``name`` (see :data:`MODEL_NAMES`) with fresh weights.

    ``image`` is used only by models whose parameters depend on the image side (``vit-tiny``:
    its position embeddings). The Sequential models (:data:`SEQUENTIAL_NAMES`) return an
    ``nn.Sequential``.
    """
    key = canonical_name(name)
    if key == "vit-tiny":
        check_image(key, image)
    return _BUILDERS[key](image)


def check_image(name: str, image: int, batch: int = 2) -> None:
    """Raise InvalidInput when ``image`` (side, or sequence length for token models) does not
    fit model ``name`` at this batch size."""
    key = canonical_name(name)
    info = MODELS[key]
    what = "sequence length" if info.input == "tokens" else "image"
    smallest = info.min_size_batch_1 if batch == 1 else info.min_size
    if image < smallest:
        raise InvalidInput(
            f"{what} {image} is too small for {key}"
            + (" with a batch of 1" if batch == 1 else "")
            + f"; use at least {smallest}"
        )
    if image % info.multiple:
        raise InvalidInput(f"{what} {image} does not fit {key}; use a multiple of {info.multiple}")
    if info.max_size is not None and image > info.max_size:
        raise InvalidInput(f"{what} {image} is too long for {key}; use at most {info.max_size}")


def sample_input(
    name: str, batch: int, size: int, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A random input for model ``name``: ``batch`` images of side ``size`` (``dtype``), or
    ``batch`` sequences of ``size`` token ids."""
    key = canonical_name(name)
    if batch < 1:
        raise InvalidInput(f"batch must be at least 1, got {batch}")
    check_image(key, size, batch)
    info = MODELS[key]
    if info.input == "tokens":
        return torch.randint(0, info.vocab, (batch, size))
    return torch.randn(batch, 3, size, size, dtype=dtype)


def model_table() -> list[dict[str, object]]:
    """One row per registered model: name, what it is, its input, the Sequential flag."""
    return [
        {
            "name": info.name,
            "description": info.description,
            "input": info.input,
            "sequential": info.sequential,
        }
        for info in MODELS.values()
    ]
