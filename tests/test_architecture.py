"""The package's layers, read from the source: what each may import, no cycles, no private names
across modules, a torch-free planning core, every module importable on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "edgetrain"

LEAVES = {"errors", "units", "progress", "jsonfile", "cache"}
DEPRECATED_ALIASES = {"edgetrain.measure"}  # kept for one release; they re-export the API

# Which layers each layer may import (its own always allowed). The public API (``edgetrain``
# itself) is for the applications on top.
ALLOWED: dict[str, set[str]] = {
    "leaves": {"leaves"},
    "core": {"leaves"},
    "devices": {"core", "leaves"},
    "planners": {"core", "devices", "leaves"},
    "autograd": {"core", "leaves"},
    "frontend": {"autograd", "core", "leaves"},
    "runtime": {"frontend", "autograd", "planners", "core", "devices", "leaves"},
    "models": {"frontend", "autograd", "core", "leaves"},
    "tiles": {"devices", "autograd", "models", "core", "leaves"},
    "paper": {"api", "models", "frontend", "runtime", "planners", "core", "devices", "leaves"},
    "insitu": {"api", "leaves"},
    "cli": {"api", "insitu", "paper", "tiles", "models", "runtime", "frontend", "autograd"}
    | {"planners", "core", "devices", "leaves"},
    "api": {"core", "planners", "leaves", "frontend", "runtime", "models", "autograd"},
}
PURE = {"leaves", "core", "devices", "planners"}
# The applications on top use the public API: ``edgetrain`` and each package's ``__all__``.
PUBLIC_API_ONLY = {"insitu", "paper"}
PURE_MODULES = {
    "edgetrain.tiles.tiling",
    "edgetrain.tiles.grid",
    "edgetrain.tiles.grouping",
    "edgetrain.tiles.rankplan",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        found[name] = path
    return found


MODULES = _modules()


def _layer(module: str) -> str:
    parts = module.split(".")
    if module == "edgetrain" or module in DEPRECATED_ALIASES:
        return "api"
    if len(parts) == 2 and parts[1] in LEAVES:
        return "leaves"
    return parts[1]


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every edgetrain import in ``path``,
    at module level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "edgetrain":
                found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("edgetrain", "torch"):
                    found.append((alias.name, [], node.lineno))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            found.append((node.module, [], node.lineno))
    return found


def _public(module: str, names: list[str]) -> bool:
    """Whether ``from module import names`` takes only a package's public names (its
    ``__all__``, read from its ``__init__.py``)."""
    path = MODULES.get(module)
    if path is None or path.name != "__init__.py" or module == "edgetrain":
        return False
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            exported = set(ast.literal_eval(node.value))
            return bool(names) and set(names) <= exported
    return False


def _targets(imported: str, names: list[str]) -> list[str]:
    """The edgetrain modules an import loads: ``from pkg import mod`` names the submodule."""
    subs = [f"{imported}.{n}" for n in names if f"{imported}.{n}" in MODULES]
    return subs or [imported]


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for imported, names, _ in _imports(path):
            if imported.startswith("edgetrain"):
                edges[module].update(t for t in _targets(imported, names) if t != module)
    return edges


def test_every_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, path in MODULES.items():
        layer = _layer(module)
        for imported, names, line in _imports(path):
            if not imported.startswith("edgetrain"):
                continue
            for target in _targets(imported, names):
                other = _layer(target)
                if layer in PUBLIC_API_ONLY and _public(target, names):
                    continue
                if other != layer and other not in ALLOWED[layer]:
                    wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} {layer} -> {target}")
    assert not wrong, "imports against the layer rules:\n" + "\n".join(wrong)


def test_the_planning_core_imports_no_torch():
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}"
        for module, path in MODULES.items()
        if _layer(module) in PURE or module in PURE_MODULES
        for imported, _, line in _imports(path)
        if imported.split(".")[0] == "torch"
    ]
    assert not wrong, "\n".join(wrong)


def test_no_module_takes_a_private_name_from_another():
    wrong = []
    for module, path in MODULES.items():
        for imported, names, line in _imports(path):
            if not imported.startswith("edgetrain") or imported == module:
                continue
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            if private or any(part.startswith("_") for part in imported.split(".")):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} {imported} {private}")
    assert not wrong, "\n".join(wrong)


def test_the_imports_have_no_cycle():
    edges = _edges()
    done: set[str] = set()
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in stack:
            return [*stack[stack.index(module) :], module]
        if module in done:
            return None
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if target == "edgetrain" or target.startswith(module + "."):
                continue  # the public API on top; a package's own submodules
            cycle = visit(target)
            if cycle:
                return cycle
        stack.pop()
        done.add(module)
        return None

    for module in sorted(MODULES):
        cycle = visit(module)
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_planning_without_torch_loads_no_torch():
    pure = sorted(
        m for m in MODULES if (_layer(m) in PURE or m in PURE_MODULES) and m != "edgetrain.measure"
    )
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in pure)
        + "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_module_imports_on_its_own():
    """Each module imported first, in a process of its own whose edgetrain modules are dropped
    between imports: none relies on another having been imported before it."""
    modules = sorted(m for m in MODULES if m != "edgetrain.measure")
    code = (
        "import importlib, sys, traceback\n"
        f"failed = []\nfor name in {modules!r}:\n"
        "    for loaded in [n for n in sys.modules if n.split('.')[0] == 'edgetrain']:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc(limit=1))\n"
        "print('\\n'.join(failed))\nsys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
