"""Reading a JSON file a user gives (a plan, a chain, a graph, a device profile): one line when it
cannot be read, is not JSON or breaks a limit, never a traceback. Pure (no torch).

Every JSON document edgetrain reads from outside goes through :func:`parse_json` (and files
through :func:`read_json`), which refuses, each with one line naming the file and the problem:

* a file larger than :data:`MAX_FILE_BYTES` (checked with ``stat`` before a byte is read);
* text that is not UTF-8 or not JSON;
* ``NaN``, ``Infinity``, ``-Infinity`` and numbers that overflow to them (``1e400``);
* integers with more than :data:`MAX_INT_DIGITS` digits and numbers of magnitude above
  :data:`MAX_MAGNITUDE` (no size, count or index edgetrain reads comes near it);
* arrays and objects nested more than :data:`MAX_DEPTH` deep.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from edgetrain.errors import CorruptFile, EdgetrainError, InvalidInput

MAX_FILE_BYTES = 64 * 2**20
"""The largest JSON file read (64 MiB; the largest plan or graph edgetrain writes is far below)."""

MAX_DEPTH = 64
"""The deepest nesting of arrays and objects accepted (edgetrain's own files nest 4 deep)."""

MAX_INT_DIGITS = 19
"""The most digits an integer may have (an int64 has 19)."""

MAX_MAGNITUDE = 1e18
"""The largest absolute value a number may have (bytes, counts, indices, seconds, watts)."""


class _Refused(ValueError):
    """A number or a nesting beyond the limits, raised from inside the JSON parser."""


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    value = int(text)
    if abs(value) > MAX_MAGNITUDE:
        raise _Refused(f"the number {text} (at most {MAX_MAGNITUDE:.0e} in size)")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} (not finite)")
    if abs(value) > MAX_MAGNITUDE:
        raise _Refused(f"the number {text[:40]} (at most {MAX_MAGNITUDE:.0e} in size)")
    return value


def _parse_constant(text: str) -> float:
    raise _Refused(f"{text} (not a finite number)")


def _depth(value: Any) -> int:
    """How deeply ``value`` nests arrays and objects (iteratively: no recursion limit)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        if depth > MAX_DEPTH:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children)
    return deepest


def parse_json(text: str, source: str, fix: str) -> Any:
    """The JSON value in ``text``, read from ``source`` ("schedule plan.json"); raises
    :class:`CorruptFile` "``source``: <problem>; ``fix``" for text that is not JSON or breaks
    a limit (see the module's docstring)."""
    try:
        value = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except _Refused as exc:
        raise CorruptFile(f"{source} holds {exc}, beyond what edgetrain reads; {fix}") from exc
    except json.JSONDecodeError as exc:
        raise CorruptFile(
            f"{source} is not valid JSON ({exc.msg} at line {exc.lineno}); {fix}"
        ) from exc
    except RecursionError as exc:
        raise CorruptFile(
            f"{source} nests arrays or objects deeper than {MAX_DEPTH} levels; {fix}"
        ) from exc
    if _depth(value) > MAX_DEPTH:
        raise CorruptFile(f"{source} nests arrays or objects deeper than {MAX_DEPTH} levels; {fix}")
    return value


def read_json(
    path: str | Path,
    what: str,
    fix: str,
    *,
    unreadable: type[EdgetrainError] = InvalidInput,
) -> Any:
    """The JSON value in ``path``, a ``what`` ("schedule", "graph"). A file that cannot be read
    raises ``unreadable`` naming the OS's reason; one that is too large, not UTF-8 text, not JSON
    or beyond the limits of :func:`parse_json` raises :class:`CorruptFile` ending in ``fix``
    ("re-plan it")."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_FILE_BYTES:
                raise CorruptFile(
                    f"{what} {path} is {size / 2**20:.0f} MiB, above the "
                    f"{MAX_FILE_BYTES // 2**20} MiB edgetrain reads; {fix}"
                )
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise unreadable(f"cannot read {what} {path}: {exc.strerror}; check the path") from exc
    if len(data) > MAX_FILE_BYTES:  # grew since the stat, or a pipe
        raise CorruptFile(
            f"{what} {path} is above the {MAX_FILE_BYTES // 2**20} MiB edgetrain reads; {fix}"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptFile(
            f"{what} {path} is not valid JSON (not UTF-8 text: byte {exc.start}); {fix}"
        ) from exc
    return parse_json(text, f"{what} {path}", fix)
