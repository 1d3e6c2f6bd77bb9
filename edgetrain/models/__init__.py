"""Models built from code (nothing is downloaded), by name.

``resnet18`` .. ``resnet152`` (torchvision's architecture, one stage per residual block) and
``yolov2-16`` (Darknet YOLOv2 layers 0-15). ``LinearResNet-x`` is not a torch model but a chain:
see :mod:`edgetrain.models.linear_resnet`.
"""

from __future__ import annotations

from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.models.resnet import ARCHITECTURES, resnet
from edgetrain.models.yolov2 import yolov2_16

MODEL_NAMES: tuple[str, ...] = (*(f"resnet{d}" for d in ARCHITECTURES), "yolov2-16")

# The smallest square image each model accepts: every downsampling step keeps at least one pixel
# (ResNet: /32, YOLOv2-16: /16); with a batch of one, BatchNorm in training needs more than one
# value per channel, so the last feature map must be at least 2x2.
MIN_IMAGE = {**{f"resnet{d}": 32 for d in ARCHITECTURES}, "yolov2-16": 16}
MIN_IMAGE_BATCH_1 = {**{f"resnet{d}": 33 for d in ARCHITECTURES}, "yolov2-16": 32}


def canonical_name(name: str) -> str:
    """The registry spelling of ``name`` ("ResNet_50" -> "resnet50"); InvalidInput if unknown."""
    key = name.strip().lower().replace("_", "-")
    if key.startswith("resnet"):
        key = "resnet" + key.removeprefix("resnet").lstrip("-")
    key = {"yolov2": "yolov2-16"}.get(key, key)
    if key not in MODEL_NAMES:
        raise InvalidInput(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return key


def build(name: str) -> nn.Sequential:
    """Build the model called ``name`` (see :data:`MODEL_NAMES`) with fresh weights."""
    key = canonical_name(name)
    if key.startswith("resnet"):
        return resnet(int(key.removeprefix("resnet")))
    return yolov2_16()


def check_image(name: str, image: int, batch: int = 2) -> None:
    """Raise InvalidInput when ``image`` is too small for model ``name`` at this batch size."""
    key = canonical_name(name)
    smallest = MIN_IMAGE_BATCH_1[key] if batch == 1 else MIN_IMAGE[key]
    if image < smallest:
        raise InvalidInput(
            f"image {image} is too small for {key}"
            + (" with a batch of 1" if batch == 1 else "")
            + f"; use at least {smallest}"
        )
