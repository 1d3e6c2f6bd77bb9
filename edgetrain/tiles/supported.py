"""Which built-in models tiles train, and the one-line answer for the others.

YOLOv2-16 is a plain chain of windows (convolutions, pooling) and element-wise layers, which tiles
train with fused groups of layers (:mod:`edgetrain.tiles.layers`). Every other CNN trains through
its captured graph (:mod:`edgetrain.tiles.graph`): residual additions, concatenations and
transposed convolutions on tiles, global pooling summed over tiles, the head on every rank. The
ViT and the language model are not CNNs: they have no feature maps to cut.

The names are plain data so that ``--help`` can list them without importing torch.
"""

from __future__ import annotations

from edgetrain.errors import InvalidInput

CHAIN_MODELS: tuple[str, ...] = ("yolov2-16",)
"""Built-in models that are a plain chain of windows: trained with fused groups (``--groups``)."""

_DEPTHS = (18, 34, 50, 101, 152)
TILE_MODELS: tuple[str, ...] = (
    *CHAIN_MODELS,
    *(f"resnet{d}" for d in _DEPTHS),
    *(f"resnet{d}-module" for d in _DEPTHS),
    "mobilenetv2",
    "unet",
)
"""Built-in models ``edgetrain tiles`` and the torchrun worker train."""

CHAIN = "a plain chain of convolutions, pooling, batch norm and activations"


def tile_model(name: str) -> str:
    """The registry name of model ``name`` if tiles train it; InvalidInput naming those they do."""
    from edgetrain.models import canonical_name  # the registry imports torch

    choices = ", ".join(TILE_MODELS)
    try:
        key = canonical_name(name)
    except InvalidInput:
        raise InvalidInput(f"unknown model {name!r}; tiles trains {choices}") from None
    if key not in TILE_MODELS:
        raise InvalidInput(
            f"tiles cannot split {key}, which has no convolutional feature maps; tiles trains "
            f"{choices}"
        )
    return key
