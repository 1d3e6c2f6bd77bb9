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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from edgetrain.errors import InvalidInput
from edgetrain.units import parse_bytes

SIZE_HELP = "1MB = 10^6 bytes, 1MiB = 2^20"
"""How sizes are read; quoted in the help of every size option."""


def int_list(text: str, what: str, *, minimum: int = 1, maximum: int | None = None) -> list[int]:
    """``"1,3,5"`` -> [1, 3, 5]; each at least ``minimum`` and at most ``maximum``."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit():
            raise InvalidInput(f"{what} {part!r} is not a whole number; write e.g. 1,3,5")
        value = int(part)
        if value < minimum:
            raise InvalidInput(f"{what} must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise InvalidInput(f"{what} must be at most {maximum}, got {value}")
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

    def __init__(self, what: str, minimum: int = 1, maximum: int | None = None) -> None:
        self.what, self.minimum, self.maximum = what, minimum, maximum

    def check(self, value: str) -> list[int]:
        return int_list(value, self.what, minimum=self.minimum, maximum=self.maximum)

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


class ModelFile(_Checked):
    """A user's model factory, ``FILE.py:FUNCTION``: the form and the file are checked (it exists,
    is a .py file); nothing in it runs until the command loads it. Gives a str."""

    name = "model_file"

    def check(self, value: str) -> str:
        from edgetrain.models.factory import model_file_path

        model_file_path(value)
        return value

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "FILE.py:FUNCTION"


class Shape(_Checked):
    """A tensor shape, comma-separated whole numbers ("8,3,32,32"); gives a tuple of ints."""

    name = "shape"

    def check(self, value: str) -> tuple[int, ...]:
        shape = tuple(int_list(value, "--input-shape"))
        if math.prod(shape) > MAX_INPUT_VALUES:
            raise InvalidInput(
                f"--input-shape {value} holds {math.prod(shape):.3g} values, more than the "
                f"{MAX_INPUT_VALUES:.3g} any command takes; give a smaller shape"
            )
        return shape

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "N,..."


MODEL_FILE_HELP = (
    "Your own model instead of --model: FILE.py:FUNCTION, where FUNCTION takes no arguments "
    "and returns the model (an nn.Module), or (model, example_input) with one example tensor "
    "that fixes the input (shape and dtype). This imports FILE and calls FUNCTION: it runs "
    "your code. The input is the example if returned, else --input-shape, else --batch RGB "
    "images of side --image. The model must be traceable by torch.fx."
)
"""The help of ``--model-file`` (plan and train)."""


@dataclass(frozen=True)
class ModelChoice:
    """The model and input a command was given (checked; nothing built or run yet).

    Attributes:
        name: a registered model (``--model``), or None for a user's file.
        file: ``FILE.py:FUNCTION`` (``--model-file``), or None.
        batch: images (or sequences) per step.
        image: image side in pixels (sequence length for a model that takes tokens).
        shape: for a file model, the input shape the user gave (``--input-shape``, or ``--batch``
            / ``--image`` typed on the command line), None when they gave none.
    """

    name: str | None
    file: str | None
    batch: int
    image: int
    shape: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        """The model's name in tables and reports (a file without its directory)."""
        if self.name is not None:
            return self.name
        path, _, function = str(self.file).rpartition(":")
        return f"{Path(path).name}:{function}"

    @property
    def default_shape(self) -> tuple[int, ...]:
        """The input of a file model whose factory gives none: a batch of square RGB images."""
        return (self.batch, 3, self.image, self.image)


def model_options(default: str, what: str) -> Callable[[Any], Any]:
    """Add --model, --model-file, --input-shape, --batch and --image to a command; ``default``
    is the model when neither --model nor --model-file is given, ``what`` ("to plan for") ends
    --model's help."""
    options = [
        click.option(
            "--model",
            "model_name",
            type=ModelName(all_model_names(), reason=""),
            default=None,
            help=f"Registered model {what} (default {default}); `edgetrain models` lists them.",
        ),
        click.option("--model-file", type=ModelFile(), default=None, help=MODEL_FILE_HELP),
        click.option(
            "--input-shape",
            type=Shape(),
            default=None,
            help="Input shape for --model-file whose factory returns only the model, e.g. "
            "8,3,64,64 (a standard normal float tensor).",
        ),
        click.option("--batch", type=BATCH, default=8, show_default=True, help="Images per step."),
        click.option(
            "--image",
            type=IMAGE,
            default=224,
            show_default=True,
            help="Image side (px); sequence length for a model that takes tokens (tinylm).",
        ),
    ]

    def decorate(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def choose_model(
    model_name: str | None,
    model_file: str | None,
    input_shape: tuple[int, ...] | None,
    batch: int,
    image: int,
    default: str,
) -> ModelChoice:
    """Check what :func:`model_options` read, before anything is built: --model and --model-file
    exclude each other, --input-shape goes with --model-file only and not with --batch or
    --image, and a registered model's image (or sequence length) must fit it."""
    from click.core import ParameterSource

    from edgetrain.models import check_image

    ctx = click.get_current_context()
    typed = [
        flag
        for flag, key in (("--batch", "batch"), ("--image", "image"))
        if ctx.get_parameter_source(key) not in (ParameterSource.DEFAULT, None)
    ]
    if model_name is not None and model_file is not None:
        raise InvalidInput("give --model or --model-file, not both")
    if model_file is None:
        if input_shape is not None:
            raise InvalidInput(
                "--input-shape is for --model-file; a registered model takes --batch and --image"
            )
        name = model_name if model_name is not None else default
        check_image(name, image, batch)
        return ModelChoice(name=name, file=None, batch=batch, image=image)
    if input_shape is not None and typed:
        raise InvalidInput(f"give --input-shape or {' and '.join(typed)}, not both")
    shape = (
        input_shape if input_shape is not None else ((batch, 3, image, image) if typed else None)
    )
    return ModelChoice(name=None, file=model_file, batch=batch, image=image, shape=shape)


def input_words(shape: tuple[int, ...]) -> str:
    """``(8, 3, 224, 224)`` -> "batch 8, 224x224"; any other shape as it is."""
    if len(shape) == 4 and shape[1] == 3 and shape[2] == shape[3]:
        return f"batch {shape[0]}, {shape[2]}x{shape[3]}"
    return f"input {tuple(shape)}"


def all_model_names() -> tuple[str, ...]:
    """Every registered model: what ``plan`` and ``train`` take."""
    from edgetrain.models import MODEL_NAMES

    return MODEL_NAMES


class FiniteRange(click.FloatRange):
    """A click.FloatRange that also refuses nan and inf (which compare false with any bound)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


POSITIVE = click.IntRange(min=1)
"""A whole number of at least 1 (steps, slots)."""

MAX_BATCH = 2**20
"""Most images (or sequences) per step any command takes: 1,048,576."""

MAX_IMAGE = 2**16
"""Largest image side (or sequence length) any command takes, in pixels: 65,536. With
:data:`MAX_BATCH` every tensor's element count and byte size stays far inside 64-bit integers."""


class AtMost(click.IntRange):
    """A whole number from 1 to ``maximum``; a larger one is refused in one line that names the
    bound (before any work: a size of 2^63 would overflow inside torch)."""

    def __init__(self, maximum: int, what: str) -> None:
        super().__init__(min=1)
        self.maximum, self.what = maximum, what

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if number > self.maximum:
            self.fail(
                f"{number} is more than {self.maximum:,} {self.what}; give at most {self.maximum}",
                param,
                ctx,
            )
        return number


MAX_INPUT_VALUES = 3 * MAX_BATCH * MAX_IMAGE**2
"""Most values an ``--input-shape`` may hold: a batch of :data:`MAX_BATCH` RGB images of side
:data:`MAX_IMAGE`."""

BATCH = AtMost(MAX_BATCH, "images per step")
"""``--batch``: 1 .. :data:`MAX_BATCH`."""

IMAGE = AtMost(MAX_IMAGE, "pixels per side")
"""``--image``: 1 .. :data:`MAX_IMAGE`."""

NON_NEGATIVE = click.IntRange(min=0)
"""A whole number of at least 0 (seeds)."""

POSITIVE_FLOAT = FiniteRange(min=0, min_open=True)
"""A number above 0 (learning rate, seconds)."""

RECOMPUTE = FiniteRange(min=1)
"""A recompute factor: at least 1 (plain autograd), finite."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class CoreCount(click.IntRange):
    """Threads: a whole number from 1 to the cores this process may use (:func:`usable_cores`)."""

    def __init__(self) -> None:
        super().__init__(min=1)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        cores = usable_cores()
        if number > cores:
            self.fail(
                f"{number} threads is more than the {cores} cores this machine gives us; "
                f"give at most {cores}",
                param,
                ctx,
            )
        return number


THREADS = CoreCount()
"""Threads per process: 1 .. the usable cores."""
