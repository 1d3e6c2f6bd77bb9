"""Reading a JSON file a user gives (a plan, a graph, a device profile): one line when it cannot
be read or is not JSON, never a traceback. Pure (no torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgetrain.errors import CorruptFile, EdgetrainError, InvalidInput


def read_json(
    path: str | Path,
    what: str,
    fix: str,
    *,
    unreadable: type[EdgetrainError] = InvalidInput,
) -> Any:
    """The JSON value in ``path``, a ``what`` ("schedule", "graph"). A file that cannot be read
    raises ``unreadable`` naming the OS's reason; one that is not UTF-8 text or not JSON raises
    :class:`CorruptFile` ending in ``fix`` ("re-plan it")."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise unreadable(f"cannot read {what} {path}: {exc.strerror}; check the path") from exc
    except UnicodeDecodeError as exc:
        raise CorruptFile(
            f"{what} {path} is not valid JSON (not UTF-8 text: byte {exc.start}); {fix}"
        ) from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptFile(
            f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno}); {fix}"
        ) from exc
