#!/usr/bin/env python
"""The line budget: modules under 600 lines, functions under 80 (docstrings not counted), each
file readable in one sitting. The few exceptions are listed below with the reason they stand.

Usage: ``python scripts/sizes.py`` (exit 1 naming what is over, and any exception no longer
needed); ``--report`` prints the largest modules and functions.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "edgetrain"
MODULE_LINES = 600
FUNCTION_LINES = 80

# path (relative to the repository) or "path:function" -> why it stands. Each is a split still
# to make; the list only shrinks (an entry within its limit again fails the check).
EXCEPTIONS: dict[str, str] = {
    "edgetrain/core/simulator.py:_replay": "the simulator's replay, one branch per op",
    "edgetrain/frontend/fx_capture.py:capture": "the tracer's set-up and restore",
    "edgetrain/frontend/stage_measure.py:profile_stage": "one stage's measured passes",
    "edgetrain/insitu/student.py:train_student": "the resumable training loop",
}


def _docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", [])
    first = body[0] if body else None
    docstring = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    return first.end_lineno - first.lineno + 1 if docstring else 0  # type: ignore[union-attr,operator]


def measure() -> tuple[dict[str, int], dict[str, int]]:
    """Lines of every module, and of every function without its docstring."""
    modules: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(ROOT))
        text = path.read_text()
        modules[name] = text.count("\n")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1 - _docstring_lines(node)  # type: ignore[operator]
                functions[f"{name}:{node.name}"] = max(
                    length, functions.get(f"{name}:{node.name}", 0)
                )
    return modules, functions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print the largest of each")
    args = parser.parse_args()
    modules, functions = measure()
    if args.report:
        for name, lines in sorted(modules.items(), key=lambda kv: -kv[1])[:15]:
            print(f"{lines:6d}  {name}")
        print()
        for name, lines in sorted(functions.items(), key=lambda kv: -kv[1])[:15]:
            print(f"{lines:6d}  {name}")
        return 0
    over = [
        f"{name}: {n} lines (module limit {MODULE_LINES})"
        for name, n in modules.items()
        if n > MODULE_LINES and name not in EXCEPTIONS
    ]
    over += [
        f"{name}: {n} lines (function limit {FUNCTION_LINES})"
        for name, n in functions.items()
        if n > FUNCTION_LINES and name not in EXCEPTIONS
    ]
    stale = [
        name
        for name in EXCEPTIONS
        if modules.get(name, functions.get(name, 0))
        <= (MODULE_LINES if ":" not in name else FUNCTION_LINES)
    ]
    for line in over:
        print(f"sizes: {line}; split it, or list it in scripts/sizes.py with the reason")
    for name in stale:
        print(f"sizes: {name} is within the limit now; remove it from EXCEPTIONS")
    return 1 if over or stale else 0


if __name__ == "__main__":
    sys.exit(main())
