"""Imports every command module so that each registers itself with the ``edgetrain`` group."""

from __future__ import annotations

import importlib
import importlib.util

COMMAND_MODULES = (
    "memory",
    "plan",
    "train",
    "figure",
    "revolve",
    "demo",
    "tiles",
    "models",
    "insitu",
    "poet",
)

for _name in COMMAND_MODULES:
    # Commands whose module is not part of this build are simply not offered; an import error
    # inside a module that exists is a bug and propagates.
    if importlib.util.find_spec(f"edgetrain.cli.{_name}") is not None:
        importlib.import_module(f"edgetrain.cli.{_name}")
