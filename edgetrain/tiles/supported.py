"""Which built-in models tiles train, and the one-line answer for the others.

Tiles split a plain chain of windows (convolutions, pooling) and element-wise layers (batch norm,
activations); :mod:`edgetrain.tiles.layers` says exactly what. Of the built-in models only
YOLOv2-16 is such a chain. The ResNets are not: a residual block adds its input back, and they end
in global pooling and a Linear layer, which need the whole map. From Python, any ``nn.Sequential``
of tileable layers trains (docs/tiles.md).

The names are plain data so that ``--help`` can list them without importing torch.
"""

from __future__ import annotations

from edgetrain.errors import InvalidInput

TILE_MODELS: tuple[str, ...] = ("yolov2-16",)
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
            f"tiles cannot split {key}, which is not {CHAIN}; tiles trains {choices}"
        )
    return key
