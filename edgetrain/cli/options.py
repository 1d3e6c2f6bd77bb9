"""The CLI's argument types and checks: every path and number is validated while the command line
is parsed, before any work starts, and a bad one ends as one line naming it and the fix.

Sizes: ``--memory 1MB`` is 10**6 bytes and ``1MiB`` 2**20 (SI and IEC prefixes, see
:mod:`edgetrain.units`); the tool prints binary units (KiB, MiB, GiB).

Output files are checked up front: the parent directory must already exist (it is never created
silently), be a directory and accept a new file (a real probe, so ``/proc`` or a read-only mount
is caught), the path must not be a directory, and its suffix must be one the command writes.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from edgetrain.errors import InvalidInput
from edgetrain.units import parse_bytes

SIZE_HELP = "1MB = 10^6 bytes, 1MiB = 2^20"
"""How sizes are read; quoted in the help of every size option."""


def int_list(text: str, what: str, *, minimum: int = 1) -> list[int]:
    """``"1,3,5"`` -> [1, 3, 5]; each at least ``minimum``."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit():
            raise InvalidInput(f"{what} {part!r} is not a whole number; write e.g. 1,3,5")
        value = int(part)
        if value < minimum:
            raise InvalidInput(f"{what} must be at least {minimum}, got {value}")
        values.append(value)
    return values


def name_list(text: str) -> list[str]:
    """``"resnet18, resnet50"`` -> ["resnet18", "resnet50"]."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise InvalidInput("give at least one model, e.g. --models resnet18,resnet50")
    return names


def size(text: str | None) -> int | None:
    """A byte size or None."""
    return None if text is None else parse_bytes(text)


def check_output_path(path: str | Path, suffixes: Sequence[str], what: str = "") -> Path:
    """Return ``path`` if a new file can be written there; InvalidInput naming the problem if not.

    ``suffixes`` lists the allowed endings (".json"; case-insensitive); ``what`` ("--save: ")
    starts the message.
    """
    target = Path(path)
    if target.suffix.lower() not in suffixes:
        raise InvalidInput(
            f"{what}{str(path)!r} must end in {' or '.join(suffixes)}"
            f"{f' (not {target.suffix})' if target.suffix else ''}; e.g. "
            f"{target.with_suffix(suffixes[0]).name}"
        )
    if target.is_dir():
        raise InvalidInput(f"{what}{str(path)!r} is a directory; give a file name inside it")
    parent = target.parent
    if not parent.exists():
        raise InvalidInput(
            f"{what}directory {str(parent)!r} does not exist; create it first or pick another"
        )
    if not parent.is_dir():
        raise InvalidInput(f"{what}{str(parent)!r} is a file, not a directory; pick another path")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise InvalidInput(
            f"{what}cannot write in {str(parent)!r} ({exc.strerror}); pick another directory"
        ) from exc
    if target.exists() and not os.access(target, os.W_OK):
        raise InvalidInput(f"{what}{str(path)!r} exists and is read-only; pick another path")
    return target


def check_input_file(path: str | Path, what: str = "") -> Path:
    """Return ``path`` if it is a readable file; InvalidInput naming the problem if not."""
    source = Path(path)
    if not source.exists():
        raise InvalidInput(f"{what}{str(path)!r} does not exist; check the path")
    if not source.is_file():
        raise InvalidInput(f"{what}{str(path)!r} is not a file; give the file itself")
    if not os.access(source, os.R_OK):
        raise InvalidInput(f"{what}{str(path)!r} is not readable; check its permissions")
    return source


class _Checked(click.ParamType):
    """A click type whose check raises InvalidInput; click shows it as one line, exit 2."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value  # a default already converted
        try:
            return self.check(value)
        except InvalidInput as exc:
            self.fail(str(exc), param, ctx)

    def check(self, value: str) -> Any:
        raise NotImplementedError


class OutputFile(_Checked):
    """A file the command will write: checked as in :func:`check_output_path`; gives a str."""

    name = "file"

    def __init__(self, *suffixes: str) -> None:
        self.suffixes = suffixes

    def check(self, value: str) -> str:
        check_output_path(value, self.suffixes)
        return value

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return f"FILE{'|'.join(self.suffixes)}".upper()


class InputFile(_Checked):
    """A file the command will read: it exists, is a file and is readable; gives a str."""

    name = "file"

    def check(self, value: str) -> str:
        check_input_file(value)
        return value


class Size(_Checked):
    """A byte size ("2GB" = 2*10^9, "2GiB" = 2^31, "4096"); gives an int."""

    name = "size"

    def check(self, value: str) -> int:
        return parse_bytes(value)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "SIZE"


class IntList(_Checked):
    """Comma-separated whole numbers, each at least ``minimum``; gives a list of ints."""

    name = "list"

    def __init__(self, what: str, minimum: int = 1) -> None:
        self.what, self.minimum = what, minimum

    def check(self, value: str) -> list[int]:
        return int_list(value, self.what, minimum=self.minimum)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "N[,N...]"


def model_names() -> tuple[str, ...]:
    """The models the chain commands accept: the registry's ``nn.Sequential`` models (the others
    have a forward() and are captured as graphs, which these commands do not plan yet)."""
    from edgetrain.models import SEQUENTIAL_NAMES

    return SEQUENTIAL_NAMES


class ModelName(_Checked):
    """A model from the registry, among ``allowed`` (default: :func:`model_names`); aliases such
    as ResNet-50 are accepted and given in the registry's spelling."""

    name = "model"

    def __init__(
        self,
        allowed: Sequence[str] | None = None,
        reason: str = "it is not an nn.Sequential chain; `edgetrain models` lists them",
    ) -> None:
        self.allowed = tuple(allowed) if allowed is not None else None
        self.reason = reason

    def choices(self) -> tuple[str, ...]:
        return self.allowed if self.allowed is not None else model_names()

    def check(self, value: str) -> str:
        from edgetrain.models import canonical_name

        key = canonical_name(value)
        if key not in self.choices():
            why = f" ({self.reason})" if self.reason else ""
            raise InvalidInput(
                f"this command does not support {key}{why}; "
                f"choose one of {', '.join(self.choices())}"
            )
        return key

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "[" + "|".join(self.choices()) + "]"

    def shell_complete(
        self, ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[Any]:
        from click.shell_completion import CompletionItem

        return [CompletionItem(n) for n in self.choices() if n.startswith(incomplete)]


class ModelList(ModelName):
    """Comma-separated model names, each as :class:`ModelName`; gives a list of str."""

    def check(self, value: str) -> list[str]:  # type: ignore[override]
        return [super(ModelList, self).check(name) for name in name_list(value)]

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "MODEL[,MODEL...]"


def resnet_names() -> tuple[str, ...]:
    """The Sequential models with a classifier head: what ``train`` supports."""
    return tuple(n for n in model_names() if n.startswith("resnet"))


class FiniteRange(click.FloatRange):
    """A click.FloatRange that also refuses nan and inf (which compare false with any bound)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


POSITIVE = click.IntRange(min=1)
"""A whole number of at least 1 (batch, steps, image side, slots)."""

NON_NEGATIVE = click.IntRange(min=0)
"""A whole number of at least 0 (seeds)."""

POSITIVE_FLOAT = FiniteRange(min=0, min_open=True)
"""A number above 0 (learning rate, seconds)."""

RECOMPUTE = FiniteRange(min=1)
"""A recompute factor: at least 1 (plain autograd), finite."""
