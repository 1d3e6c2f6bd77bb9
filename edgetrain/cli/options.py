"""Parsing of the CLI's list and size arguments, with one-line errors that say the fix."""

from __future__ import annotations

from edgetrain.errors import InvalidInput
from edgetrain.units import parse_bytes


def int_list(text: str, what: str, *, minimum: int = 1) -> list[int]:
    """``"1,3,5"`` -> [1, 3, 5]; each at least ``minimum``."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit():
            raise InvalidInput(f"{what} {part!r} is not a whole number; write e.g. 1,3,5")
        value = int(part)
        if value < minimum:
            raise InvalidInput(f"{what} must be at least {minimum}, got {value}")
        values.append(value)
    return values


def name_list(text: str) -> list[str]:
    """``"resnet18, resnet50"`` -> ["resnet18", "resnet50"]."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise InvalidInput("give at least one model, e.g. --models resnet18,resnet50")
    return names


def size(text: str | None) -> int | None:
    """A byte size or None."""
    return None if text is None else parse_bytes(text)
