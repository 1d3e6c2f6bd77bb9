"""Import the model libraries of the ``zoo`` extra: torchvision, timm and Hugging Face transformers.

torchvision's wheel from PyPI carries C operators built against the CUDA build of torch. Beside
the CPU build its import fails with "operator torchvision::nms does not exist", and timm's and
transformers' vision models, which import torchvision, fail with it. The model definitions use
none of those operators; only the Python registrations of ``nms`` and ``qnms`` (fake kernels for
detection models) need their schemas. :func:`torchvision` defines the two schemas with
``torch.library`` when, and only when, the import fails for that reason, then imports again. On a
machine where torchvision's operators load (its ``+cpu`` wheel), nothing is defined.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch

from edgetrain.errors import InvalidInput

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY: list[torch.library.Library] = []  # kept alive: dropping it would undefine the schemas


def _forget(package: str) -> None:
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]


def _import(name: str, extra_hint: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == name.split(".")[0]:
            raise InvalidInput(
                f"{name} is not installed; install the model libraries with {extra_hint}"
            ) from None
        raise


def torchvision() -> ModuleType:
    """``import torchvision``, defining its two operator schemas first if the import needs them."""
    try:
        return _import("torchvision", "pip install 'edgetrain[zoo]'")
    except RuntimeError as exc:
        if "torchvision::nms does not exist" not in str(exc):
            raise
    _forget("torchvision")
    if not _LIBRARY:
        library = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            library.define(schema)
        _LIBRARY.append(library)
    return _import("torchvision", "pip install 'edgetrain[zoo]'")


def timm() -> ModuleType:
    """``import timm`` (which imports torchvision: see :func:`torchvision`)."""
    torchvision()
    return _import("timm", "pip install 'edgetrain[zoo]'")


def transformers() -> ModuleType:
    """``import transformers`` (its vision models import torchvision: see :func:`torchvision`)."""
    torchvision()
    return _import("transformers", "pip install 'edgetrain[zoo]'")
