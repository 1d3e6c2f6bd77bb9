"""Where edgetrain keeps what it measures once per machine (a calibration, a trained teacher),
and the one format of a kept measurement: its values, the machine they were measured on and a
checksum, verified when read (a damaged or foreign file is measured again). Pure (no torch)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """``$EDGETRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/edgetrain``, else ``~/.cache/edgetrain``."""
    explicit = os.environ.get("EDGETRAIN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgetrain"


def machine(*details: str) -> str:
    """This machine (host name, architecture, CPU count) and ``details`` (a torch version, a
    thread count, what a measurement's layout depends on): the key a measurement is kept under."""
    return "|".join([platform.node(), platform.machine(), str(os.cpu_count()), *details])


def measured_path(name: str, key: str) -> Path:
    """Where the measurement ``name`` (``"device_speed.json"``) of machine ``key`` is kept: one
    file per key in :func:`cache_dir`, so machines and thread counts sharing a home directory do
    not overwrite each other."""
    stem, suffix = os.path.splitext(name)
    return cache_dir() / f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}{suffix}"


def _digest(key: str, values: dict[str, Any]) -> str:
    text = json.dumps({"machine": key, "values": values}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def measured_text(key: str, values: dict[str, Any]) -> str:
    """The text of a kept measurement: ``values``, the machine ``key`` and a checksum of both
    (write it atomically)."""
    document = {"machine": key, "values": values, "sha256": _digest(key, values)}
    return json.dumps(document, indent=1) + "\n"


def read_measured(path: os.PathLike[str] | str, key: str) -> dict[str, Any] | None:
    """The values kept at ``path`` for machine ``key``, or None: missing, unreadable, damaged
    (the checksum does not match) or another machine's, each a reason to measure again."""
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
        values = document["values"]
        if document["machine"] != key or document["sha256"] != _digest(key, values):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return values if isinstance(values, dict) else None
