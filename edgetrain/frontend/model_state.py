"""A model's state saved and put back around a trace or a recording run: its modules' attributes
(a ``forward()`` that assigns one is refused), its buffers and the RNG state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from edgetrain.frontend.fx_tracer import CONSTANT_PREFIX

_Snapshot = list[tuple[str, nn.Module, dict[str, Any], list[dict[str, Any]]]]


def snapshot(model: nn.Module) -> _Snapshot:
    """Each module's path, itself, its ``vars()`` and its module, parameter and buffer dicts,
    as shallow copies: what :func:`restore_snapshot` puts back."""
    return [
        (path, m, dict(vars(m)), [dict(m._modules), dict(m._parameters), dict(m._buffers)])
        for path, m in model.named_modules()
    ]


def restore_snapshot(before: _Snapshot) -> str | None:
    """Undo what tracing ``forward()`` assigned to the modules ``before`` lists (attributes,
    submodules, parameters, buffers); returns the first it assigned (``"head.aux_loss"``: a
    traced value, an fx Proxy; a counter ``self.steps += 1``; a submodule made in forward), or
    None."""
    stored = None
    for path, module, attributes, registries in before:
        now = [vars(module), module._modules, module._parameters, module._buffers]
        for current, old in zip(now, [attributes, *registries], strict=True):
            changed = [n for n, v in current.items() if old.get(n, _MISSING) is not v]
            changed += [n for n in old if n not in current]
            assigned = [
                n for n in changed if not n.startswith(CONSTANT_PREFIX)
            ]  # not fx's constants
            if assigned and stored is None:
                stored = f"{path}.{assigned[0]}" if path else assigned[0]
            if changed:
                current.clear()
                current.update(old)
    return stored


_MISSING = object()


@contextlib.contextmanager
def restored(model: nn.Module) -> Iterator[None]:
    """Restore the RNG state and every buffer (BatchNorm statistics) on exit."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)
