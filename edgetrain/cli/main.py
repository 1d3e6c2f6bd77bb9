"""The ``edgetrain`` command: a thin layer over the library.

Every command prints a rich table, or with ``--json`` the same data for machines. Mistakes a user
can make end as one line on stderr naming the problem and the fix, with exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from edgetrain.errors import EdgetrainError


class _Group(click.Group):
    """A click group that turns EdgetrainError into a one-line message and exit status 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except EdgetrainError as exc:
            click.echo(f"edgetrain: error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgetrain")
def cli() -> None:
    """Train neural networks on memory-limited edge devices."""


def register(command: Callable[..., Any] | click.Command) -> click.Command:
    """Add a command to the ``edgetrain`` group (used by the command modules)."""
    assert isinstance(command, click.Command)
    cli.add_command(command)
    return command


def main() -> None:
    """Console-script entry point."""
    from edgetrain.cli import commands  # noqa: F401  (registers every command)

    cli(prog_name="edgetrain")
