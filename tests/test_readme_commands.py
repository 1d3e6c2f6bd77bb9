"""Every command of the README's ``## Commands`` table runs as written and exits 0.

The table's first column holds one backticked example command per row. The rows run in table
order in one scratch directory (a later row may read what an earlier one wrote: a plan, a
graph), in-process through click. Rows of ``scripts/...`` are not edgetrain commands and are
skipped, and so are ``insitu``, ``tiles``, ``figure1`` and ``demo`` (minutes each on a 2-core
machine: a teacher to train, processes to start, five models' trade-off curves, the paper's 80
table cells; their own tests run them).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgetrain.cli.main import cli

README = Path(__file__).resolve().parents[1] / "README.md"
SLOW = ("insitu", "tiles", "figure1", "demo")


def table_commands(markdown: str) -> list[str]:
    """The backticked command in the first column of each row of the table under the heading
    ``## Commands`` (``\\|`` in a cell is a literal ``|``)."""
    lines = markdown.splitlines()
    starts = [i for i, line in enumerate(lines) if re.fullmatch(r"##\s+Commands\s*", line)]
    if not starts:
        return []
    commands = []
    for line in lines[starts[0] + 1 :]:
        if line.startswith("#"):
            break
        if not line.lstrip().startswith("|"):
            continue
        first = re.split(r"(?<!\\)\|", line.strip())[1]
        found = re.search(r"`([^`]+)`", first)
        if found:
            commands.append(found.group(1).replace("\\|", "|").strip())
    return commands


COMMANDS = table_commands(README.read_text(encoding="utf-8"))


def test_the_readme_has_a_commands_table():
    assert COMMANDS, f"{README.name} has no '## Commands' table with a backticked command per row"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("readme")


def test_the_table_parser_reads_the_first_column():
    text = "## Commands\n\n| command | what |\n|---|---|\n| `edgetrain models --json` | a \\| b |\n"
    text += "| `edgetrain revolve --steps 9 --slots 2` | counts |\n\n## Next\n| `not this` | x |\n"
    assert table_commands(text) == [
        "edgetrain models --json",
        "edgetrain revolve --steps 9 --slots 2",
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_command_exits_0(command, workspace, monkeypatch):
    words = shlex.split(command)
    if words[0] != "edgetrain":
        pytest.skip(f"not an edgetrain command: {words[0]}")
    if words[1] in SLOW:
        pytest.skip(f"`edgetrain {words[1]}` takes minutes; its own tests run it")
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("EDGETRAIN_CACHE_DIR", str(workspace / "cache"))
    result = CliRunner().invoke(cli, words[1:])
    assert result.exit_code == 0, f"{command}\n{result.output[-3000:]}"
