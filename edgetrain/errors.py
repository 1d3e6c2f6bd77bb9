"""Errors a user can cause. Each carries a one-line message that names the problem and the fix.

The CLI turns every :class:`EdgetrainError` into that line on stderr and exit status 2. Anything
else that escapes is a bug in edgetrain and stays a normal exception with its traceback.
"""

from __future__ import annotations


class EdgetrainError(Exception):
    """Base class: a problem with the user's input, not a bug."""


class InvalidInput(EdgetrainError, ValueError):
    """An argument has a bad value or form (a size, a batch, a model name, a file)."""


class InfeasibleBudget(EdgetrainError):
    """No plan meets the requested memory or recompute budget.

    ``smallest`` holds the smallest feasible value (bytes for memory, a factor for recompute)
    when one exists.
    """

    def __init__(self, message: str, smallest: float | None = None) -> None:
        super().__init__(message)
        self.smallest = smallest


class InvalidSchedule(EdgetrainError):
    """A schedule cannot run on its chain (an operation needs a value that is not in memory)."""


class CorruptFile(EdgetrainError):
    """A file edgetrain wrote earlier does not parse or fails its checksum."""
