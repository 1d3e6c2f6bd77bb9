"""Chains of the registered models, sized from shapes on the meta device."""

from __future__ import annotations

from dataclasses import replace

import torch

from edgetrain.core.chain import Chain
from edgetrain.errors import InvalidInput
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.models.registry import MODELS, build, canonical_name, check_image


def model_chain(name: str, batch: int, image: int, *, timing: bool = True) -> Chain:
    """The analytic chain of a registered model (see :mod:`edgetrain.models`) for a batch of
    ``batch`` square RGB images of side ``image`` (or ``batch`` sequences of ``image`` token ids,
    for a model that takes tokens), built on the meta device (no memory, no data). A model with
    a ``forward()`` is captured and cut into stages as in :func:`analytic_chain`.

    ``timing=False`` skips the FLOP count (stage times are then 0): enough for memory tables.
    """
    if batch < 1:
        raise InvalidInput(f"batch must be at least 1, got {batch}")
    key = canonical_name(name)
    check_image(key, image, batch)
    info = MODELS[key]
    with torch.device("meta"):
        model = build(key, image=image)
    if info.input == "tokens":
        sample = torch.empty(batch, image, dtype=torch.long, device="meta")
    else:
        sample = torch.empty(batch, 3, image, image, device="meta")
    chain = analytic_chain(model, sample, timing=timing)
    return replace(chain, name=key)
