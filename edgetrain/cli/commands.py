"""Imports every command module so that each registers itself with the ``edgetrain`` group."""

from __future__ import annotations

import contextlib
import importlib

COMMAND_MODULES = ("memory", "plan", "train", "figure", "revolve", "demo", "tiles")

for _name in COMMAND_MODULES:
    # A module that is not written yet is simply absent from the command list.
    with contextlib.suppress(ModuleNotFoundError):
        importlib.import_module(f"edgetrain.cli.{_name}")
