"""Where edgetrain keeps what it measures once per machine (a calibration, a trained teacher)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$EDGETRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/edgetrain``, else ``~/.cache/edgetrain``."""
    explicit = os.environ.get("EDGETRAIN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgetrain"
