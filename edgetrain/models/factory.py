"""Load a user's own model from a Python file: ``load_factory("my_model.py:build")``.

The file is imported as a fresh module (not added to ``sys.modules``), the named function is
called with no arguments, and what it returns must be an ``nn.Module``. Every way this can go
wrong that the user controls (no such file, no colon, no such function, an import that raises,
a result that is not a module) is an :class:`~edgetrain.errors.InvalidInput` with one line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from torch import nn

from edgetrain.errors import InvalidInput


def load_factory(spec: str) -> nn.Module:
    """Import ``path.py`` and return ``function()`` for ``spec = "path.py:function"``."""
    path_text, sep, function = spec.rpartition(":")
    if not sep or not path_text or not function.isidentifier():
        raise InvalidInput(
            f"model file {spec!r} is not FILE.py:FUNCTION; write e.g. my_model.py:build"
        )
    path = Path(path_text)
    if not path.is_file():
        raise InvalidInput(f"model file {path_text!r} does not exist; give the path of a .py file")
    module_spec = importlib.util.spec_from_file_location(f"_edgetrain_user_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise InvalidInput(f"model file {path_text!r} is not a Python module; give a .py file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise InvalidInput(
            f"importing {path_text!r} failed: {type(exc).__name__}: {exc}; fix the file"
        ) from exc
    factory = getattr(module, function, None)
    if not callable(factory):
        raise InvalidInput(
            f"{path_text!r} has no function {function!r}; define def {function}(): return model"
        )
    model = factory()
    if not isinstance(model, nn.Module):
        raise InvalidInput(
            f"{spec} returned {type(model).__name__}, not an nn.Module; return the model itself"
        )
    return model
