"""Models built from code (nothing is downloaded), by name.

Two kinds. The paper's models are ``nn.Sequential`` chains of stages, what the profiler and the
chain planners take: ``resnet18`` .. ``resnet152`` (torchvision's architecture, one stage per
residual block) and ``yolov2-16`` (Darknet YOLOv2 layers 0-15). The others are ordinary modules
with a ``forward()``, written the way users write them (residuals, long skips, attention, tied
weights): ``resnet18-module`` .. ``resnet152-module`` (torchvision's layout, identical parameters
and outputs to the Sequential form), ``mobilenetv2``, ``unet``, ``vit-tiny`` and ``tinylm`` (token
input, output layer tied to the embedding); :mod:`edgetrain.frontend.fx_capture` turns them into
graphs.
:data:`MODELS` describes each; :func:`load_factory` builds a user's own model from a file.
``LinearResNet-x`` is not a torch model but a chain: see :mod:`edgetrain.paper.linear_resnet`.
"""

from __future__ import annotations

from edgetrain.models.chains import model_chain
from edgetrain.models.factory import UserModel, load_factory, load_model_file
from edgetrain.models.registry import (
    MIN_IMAGE,
    MODEL_NAMES,
    MODELS,
    SEQUENTIAL_NAMES,
    ModelInfo,
    build,
    canonical_name,
    check_image,
    model_table,
    sample_input,
)

__all__ = [
    "MIN_IMAGE",
    "MODELS",
    "MODEL_NAMES",
    "SEQUENTIAL_NAMES",
    "ModelInfo",
    "UserModel",
    "build",
    "canonical_name",
    "check_image",
    "load_factory",
    "load_model_file",
    "model_chain",
    "model_table",
    "sample_input",
]
