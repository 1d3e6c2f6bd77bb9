"""The tree speaks of the project as it is: code, tests, docs, benchmarks and their data name no
issue numbers, no files outside the repository and nothing of how the work was organised (how a
thing came to be belongs in git log and CHANGELOG.md)."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(
    r"\bissue\s*#?\d+|#(?:2[89]|3[01])\b|(?<!profiler )(?<!profiler's )(?<!\.)\bsession\b"
    r"|\breview(?:s|ed|er|ers)?\b(?!-)"
    r"|\.\./shared|\bpreviously\b|\bused to be\b|\bformerly\b|\bwas fixed\b|\bfixed in\b"
    r"|\bfound by (?:a|an|the) (?:run|session|review)",
    re.IGNORECASE,
)


def _tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    skipped = {"CHANGELOG.md", "tests/test_no_history.py"}  # history's place; the patterns
    return [ROOT / name for name in listed if name not in skipped and not name.endswith(".png")]


def test_no_file_in_the_tree_narrates_its_history():
    found = []
    for path in _tracked_text_files():
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
