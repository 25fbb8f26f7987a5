"""The project's error types. The CLI maps them to messages and exit codes in one place (cli/app.py).

A `CompilewatchError` is a condition a user can act on: it carries a clean message, an optional hint
("what to do"), and the exit code the CLI returns for it. Anything else that escapes is a bug and is
shown with its traceback.
"""

from __future__ import annotations


class CompilewatchError(Exception):
    """Base class for errors whose message is meant for the user (exit code 2 unless overridden)."""

    exit_code: int = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


class BadInput(CompilewatchError):
    """Bad input or usage: a wrong argument, a missing file, an unreadable format. Exit code 2."""

    exit_code = 2


class CheckFailed(CompilewatchError):
    """A check that ran and found a problem, reported as an error (exit code 1)."""

    exit_code = 1


class WriteFailed(CompilewatchError, OSError):
    """A file could not be written (a full disk, an I/O error, a read-only or unwritable place).
    Exit code 2. Also an OSError with the original `errno`, so code that tolerates a failed
    best-effort write (`except OSError`) keeps doing so."""

    exit_code = 2
