"""The errors mlx-dq raises for a user's mistake or a damaged file: the CLI prints these as one line.

Anything else that escapes a command is a bug and keeps its traceback. Each class
derives from ValueError so callers that caught ValueError before keep working.
"""

from __future__ import annotations

from typing import TypeVar

_E = TypeVar("_E", bound="MlxDqError")


class MlxDqError(ValueError):
    """A user error or a bad input file; the message is one line, fit to print after ``Error:``."""

    @classmethod
    def at(cls: type[_E], path: object, what: str) -> _E:
        """This error about one file: ``<path>: <what>``, the form every message about a file's content takes."""
        return cls(f"{path}: {what}")


class InputError(MlxDqError):
    """An argument, model, text or file that mlx-dq cannot use as it is."""


class OutputError(MlxDqError):
    """A run refused to write: the output would replace or lose something mlx-dq did not write."""


class IntegrityError(MlxDqError):
    """A folder or file mlx-dq wrote was changed or damaged since (checksum, header, missing part)."""
