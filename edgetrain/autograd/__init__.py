"""How one stage runs inside autograd and how its memory is counted (torch)."""

from __future__ import annotations

from edgetrain.autograd.storage_counter import StorageCounter, storage_bytes

__all__ = ["StorageCounter", "storage_bytes"]
