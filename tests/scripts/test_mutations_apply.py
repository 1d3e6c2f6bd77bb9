"""Every mutation of ``scripts/mutate.py`` still applies: its snippet occurs exactly once in its
file, so a refactor that moves the code it targets turns this red instead of the mutation
quietly reporting "not found"."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
assert SPEC is not None and SPEC.loader is not None
MUTATE = importlib.util.module_from_spec(SPEC)
sys.modules.setdefault("mutate", MUTATE)  # its dataclasses look their module up
SPEC.loader.exec_module(MUTATE)


@pytest.mark.parametrize("mutation", MUTATE.MUTATIONS, ids=lambda m: m.name)
def test_the_mutation_snippet_occurs_once_in_its_file(mutation):
    text = (ROOT / mutation.file).read_text()
    assert text.count(mutation.original) == 1, (mutation.file, mutation.original)
    assert mutation.replacement != mutation.original
    assert all((ROOT / test).exists() for test in mutation.tests), mutation.tests
