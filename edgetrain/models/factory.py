"""Load a user's own model from a Python file: ``load_factory("my_model.py:build")``.

The factory is a function of no arguments in that file. It returns the model (an ``nn.Module``),
or a pair ``(model, example_input)`` whose tensor fixes the input a training step feeds the model
(its shape and dtype: token ids for a language model, say). Loading *runs the user's code*: the
file is imported as a fresh module (not added to ``sys.modules``; its directory is on
``sys.path`` meanwhile, so it can import the modules beside it) and the function is called.

Every way this can go wrong that the user controls is an :class:`~edgetrain.errors.InvalidInput`
with one line: no colon or no function name, no such file (checked before anything runs, see
:func:`model_file_path`), an import that raises, no such function, a factory that raises, a
result that is neither a module nor a (module, tensor) pair, and a file or factory that runs
longer than :data:`FACTORY_SECONDS` (an endless loop): a timer interrupts the import or the call
(in the main thread; elsewhere they run unbounded).
"""

from __future__ import annotations

import _thread
import contextlib
import importlib.util
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from edgetrain.errors import InvalidInput

FACTORY_FORMS = "return model or (model, example_input)"
"""What a factory may return, in the words error messages use."""

FACTORY_SECONDS = 300.0
"""Longest time, in seconds, importing a model file and then calling its factory may each take."""


class _OutOfTime(BaseException):
    """Raised by the timer inside the user's code; a BaseException so that the code's own
    ``except Exception`` does not swallow it."""


@dataclass(frozen=True)
class UserModel:
    """What a user's factory built.

    Attributes:
        spec: ``"path.py:function"`` as given.
        model: the module.
        example_input: the input the factory returned with it, or None (the caller decides).
    """

    spec: str
    model: nn.Module
    example_input: torch.Tensor | None

    def sample(self, shape: tuple[int, ...] | None, default_shape: tuple[int, ...]) -> torch.Tensor:
        """The input a step feeds the model: the factory's example input; else a standard normal
        float tensor of ``shape`` (given by the user) or ``default_shape``. A ``shape`` given
        for a factory that returns its own example is refused (one of them would be ignored)."""
        if self.example_input is not None:
            if shape is not None:
                raise InvalidInput(
                    f"{self.spec} returns its own example input, of shape "
                    f"{tuple(self.example_input.shape)}; drop the shape given (--input-shape, "
                    "--batch or --image on the command line), or return only the model"
                )
            return self.example_input
        return torch.randn(shape if shape is not None else default_shape)


def model_file_path(spec: str) -> tuple[Path, str]:
    """The file and function named by ``"path.py:function"``, checked without running anything:
    the form, and that the file exists and is a readable regular file."""
    path_text, sep, function = spec.rpartition(":")
    if not sep or not path_text or not function.isidentifier():
        raise InvalidInput(
            f"model file {spec!r} is not FILE.py:FUNCTION; write e.g. my_model.py:build"
        )
    path = Path(path_text)
    if path.is_dir():
        raise InvalidInput(f"model file {path_text!r} is a directory; give the path of a .py file")
    if not path.is_file():
        raise InvalidInput(f"model file {path_text!r} does not exist; give the path of a .py file")
    if path.suffix != ".py":
        raise InvalidInput(f"model file {path_text!r} is not a .py file; give a Python file")
    return path, function


def load_model_file(spec: str, seconds: float | None = None) -> UserModel:
    """Import ``path.py`` and call ``function()`` for ``spec = "path.py:function"``; see the
    module docstring for what the function may return. The import and the call may each take
    ``seconds`` (default :data:`FACTORY_SECONDS`)."""
    limit = FACTORY_SECONDS if seconds is None else seconds
    path, function = model_file_path(spec)
    module_spec = importlib.util.spec_from_file_location(f"_edgetrain_user_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise InvalidInput(f"model file {str(path)!r} is not a Python module; give a .py file")
    module = importlib.util.module_from_spec(module_spec)
    with _importable_from(path.resolve().parent):
        try:
            with _time_limit(limit):
                module_spec.loader.exec_module(module)
        except _OutOfTime as exc:
            raise InvalidInput(
                f"importing {str(path)!r} did not finish within {limit:g} s (an endless loop?); "
                "fix the file"
            ) from exc
        except SystemExit as exc:
            raise InvalidInput(
                f"importing {str(path)!r} called sys.exit({exc.code!r}); put the script's own "
                f'code under if __name__ == "__main__":'
            ) from exc
        except Exception as exc:
            raise InvalidInput(
                f"importing {str(path)!r} failed: {_one_line(exc)}; fix the file"
            ) from exc
        factory = getattr(module, function, None)
        if not callable(factory):
            raise InvalidInput(
                f"{str(path)!r} has no function {function!r}; "
                f"define def {function}(): {FACTORY_FORMS}"
            )
        try:
            with _time_limit(limit):
                built = factory()
        except _OutOfTime as exc:
            raise InvalidInput(
                f"{spec} did not return within {limit:g} s (an endless loop?); make it return "
                "the model"
            ) from exc
        except SystemExit as exc:
            raise InvalidInput(
                f"{spec} called sys.exit({exc.code!r}); the factory must return the model"
            ) from exc
        except Exception as exc:
            raise InvalidInput(f"{spec} raised {_one_line(exc)}; fix the factory") from exc
    example = None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        built, example = built
        if not isinstance(example, torch.Tensor):
            raise InvalidInput(
                f"{spec} returned (model, {type(example).__name__}); the example input must "
                f"be one tensor: {FACTORY_FORMS}"
            )
    if not isinstance(built, nn.Module):
        raise InvalidInput(
            f"{spec} returned {type(built).__name__}, not an nn.Module; {FACTORY_FORMS}"
        )
    return UserModel(spec=spec, model=built, example_input=example)


def load_factory(spec: str) -> nn.Module:
    """Import ``path.py`` and return the model ``function()`` builds for
    ``spec = "path.py:function"`` (an example input it returns with it is dropped)."""
    return load_model_file(spec).model


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`_OutOfTime` in the main thread after ``seconds``: a timer thread delivers
    SIGALRM to this process's Python handler (``_thread.interrupt_main``; no OS timer is set, so
    one already running is left alone), and the previous handler is restored after. Off the
    main thread the block runs without a limit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    lock = threading.Lock()
    running = True

    def expire(signum: int, frame: object) -> None:
        if running:
            raise _OutOfTime

    def ring() -> None:
        with lock:
            if running:
                _thread.interrupt_main(signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, expire)
    timer = threading.Timer(seconds, ring)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            running = False
        timer.cancel()
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _importable_from(directory: Path) -> Iterator[None]:
    """Put ``directory`` first on ``sys.path`` while the user's file loads and its factory runs,
    as ``python my_model.py`` would, so the file can import the modules beside it."""
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        if entry in sys.path:
            sys.path.remove(entry)


def _one_line(exc: Exception) -> str:
    """``Type: first line of the message``."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
