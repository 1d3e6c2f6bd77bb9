"""The suite's known-heavy files run first (tests/conftest.py): each listed file exists, and the
collection hook puts their tests first, in the listed order, each file's tests together and in
their order, the other tests after them in theirs."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import HEAVY_FIRST, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Collected:
    nodeid: str


def test_every_heavy_file_listed_exists():
    missing = [path for path in HEAVY_FIRST if not (ROOT / path).is_file()]
    assert not missing, f"tests/conftest.py HEAVY_FIRST names files that are gone: {missing}"


def test_the_hook_moves_the_heavy_files_first_in_their_order():
    first, second = HEAVY_FIRST[0], HEAVY_FIRST[1]
    names = [
        "tests/a.py::t1",
        f"{second}::x",
        "tests/b.py::t[1]",
        f"{first}::y",
        f"{first}::z[2]",
        "tests/b.py::t[2]",
    ]
    items = [Collected(name) for name in names]
    pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [item.nodeid for item in items] == [
        f"{first}::y",
        f"{first}::z[2]",
        f"{second}::x",
        "tests/a.py::t1",
        "tests/b.py::t[1]",
        "tests/b.py::t[2]",
    ]


def test_the_heavy_files_of_a_run_come_first(request: pytest.FixtureRequest):
    files = [item.nodeid.split("::")[0] for item in request.session.items]
    start = 0
    for path in (path for path in HEAVY_FIRST if path in files):
        count = files.count(path)
        assert files[start : start + count] == [path] * count, path
        start += count


@pytest.mark.xdist_group("suite-order")
def test_xdist_groups_hold_under_the_pinned_pytest(request: pytest.FixtureRequest):
    # pytest-xdist 3.8 groups a test by a suffix it adds to the test's id; pytest 9.2 ignores it,
    # and then a group's tests (and their module fixtures) spread over both workers.
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a pytest-xdist run with --dist loadgroup")
    assert request.node.nodeid.endswith("@suite-order"), request.node.nodeid
