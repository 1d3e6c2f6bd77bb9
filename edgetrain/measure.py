"""Deprecated module path, kept for one release: use ``edgetrain.StorageCounter``."""

from __future__ import annotations

import warnings

from edgetrain.autograd.storage_counter import StorageCounter, storage_bytes, storage_key

__all__ = ["StorageCounter", "storage_bytes", "storage_key"]

warnings.warn(
    "edgetrain.measure is deprecated and goes in the next release; use edgetrain.StorageCounter",
    DeprecationWarning,
    stacklevel=2,
)
