"""Byte sizes: parse "2GB" / "512MiB" / "1.5e9" into bytes, and format bytes for people.

Decimal prefixes (kB, MB, GB) are powers of 1000 and binary ones (KiB, MiB, GiB) powers of 1024,
as in the SI/IEC standards. The paper's tables use MB = 2**20 bytes; :data:`MB_PAPER` names that.
"""

from __future__ import annotations

import math
import re

from edgetrain.errors import InvalidInput

MB_PAPER = 2**20
"""The paper's "MB" (Tables I and II) is a mebibyte: 2**20 bytes; its "GB" (Table III) is 2**30."""

_FACTORS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """Return the number of bytes in ``text`` ("2GB", "512 MiB", "1e9", 4096).

    Raises :class:`InvalidInput` with the accepted forms when ``text`` does not parse or is
    not positive.
    """
    if isinstance(text, bool):
        raise InvalidInput(f"size {text!r} is not a size; give bytes or a value like 2GB")
    if isinstance(text, int | float):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(text)
        if match is None or match.group(2).lower() not in _FACTORS:
            raise InvalidInput(
                f"cannot read size {text!r}; write a number with an optional unit, "
                "e.g. 2GB, 512MB, 1.5GiB or 4096"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(value * _FACTORS[unit]):
        raise InvalidInput(f"size {text!r} is not a finite number of bytes; e.g. 2GB")
    size = int(value * _FACTORS[unit])
    if size <= 0:
        raise InvalidInput(f"size {text!r} must be positive; e.g. 2GB")
    return size


def format_bytes(size: float) -> str:
    """Format a byte count with a binary prefix: 1536 -> "1.50 KiB", 2**31 -> "2.00 GiB"."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def mib(size: float) -> float:
    """Bytes to mebibytes (the paper's MB)."""
    return size / MB_PAPER
