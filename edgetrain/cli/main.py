"""The ``edgetrain`` command: a thin layer over the library.

Every command prints a rich table, or with ``--json`` the same data for machines. Mistakes a user
can make (a bad flag, value or path, checked before any work starts, or an EdgetrainError from the
library) end as one line on stderr naming the problem and the fix, with exit status 2.
Units: sizes are printed in binary units (KiB, MiB, GiB = 2^10, 2^20, 2^30 bytes); sizes typed
in are read as written (``1MB`` = 10^6 bytes, ``1MiB`` = 2^20). Progress goes to stderr.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from edgetrain.cli.commands import COMMANDS, EXTRAS, RENAMED_FLAGS
from edgetrain.errors import EdgetrainError, InvalidInput


def _usage_line(exc: click.UsageError) -> str:
    """Click's message for a bad command line, on one line, with where to look for help."""
    message = " ".join(exc.format_message().split())
    where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
    return f"edgetrain: error: {message}{where}"


class _Group(click.Group):
    """A click group that turns EdgetrainError and click's usage errors (a bad flag or value)
    into a one-line message and exit status 2, and loads each command of
    :data:`~edgetrain.cli.commands.COMMANDS` when it is used."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _renamed(args))

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module_name, attribute = COMMANDS[cmd_name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            extra = EXTRAS.get(cmd_name)
            if extra is None or (exc.name or "").split(".")[0] not in extra[1]:
                raise
            return _needs_extra(cmd_name, extra[0], exc.name or "")
        command = getattr(module, attribute)
        assert isinstance(command, click.Command)
        return command

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            click.echo(_usage_line(exc), err=True)
            sys.exit(2)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except EdgetrainError as exc:
            click.echo(f"edgetrain: error: {exc}", err=True)
            sys.exit(2)
        except click.UsageError as exc:
            click.echo(_usage_line(exc), err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgetrain")
def cli() -> None:
    """Train neural networks on memory-limited edge devices.

    Sizes are printed in binary units (MiB = 2^20 bytes, GiB = 2^30) and read as written:
    --memory 1MB is 10^6 bytes, 1MiB is 2^20. Progress goes to stderr
    (EDGETRAIN_PROGRESS=0 silences it).
    """


def _renamed(args: list[str]) -> list[str]:
    """``args`` with a command's renamed flags (:data:`~edgetrain.cli.commands.RENAMED_FLAGS`)
    written with their new names, each noted once on stderr."""
    command = next((a for a in args if not a.startswith("-")), None)
    out = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        new = RENAMED_FLAGS.get((command or "", flag))
        if new is not None:
            click.echo(
                f"edgetrain: note: {command} {flag} is now {new}; the old name goes in the next "
                "release",
                err=True,
            )
            arg = new + eq + value
        out.append(arg)
    return out


def _needs_extra(name: str, extra: str, missing: str) -> click.Command:
    """A stand-in for a command whose optional dependencies are not installed: it says which
    extra to install, in one line, exit status 2."""

    def refuse(**_: Any) -> None:
        raise InvalidInput(
            f"edgetrain {name} needs the {extra!r} extra ({missing} is not installed); "
            f"install it with: pip install 'edgetrain[{extra}]'"
        )

    return click.Command(
        name,
        callback=refuse,
        help=f"(needs pip install 'edgetrain[{extra}]')",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="edgetrain")
