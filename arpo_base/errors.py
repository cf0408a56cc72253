"""User-facing errors: one clear line plus a hint, printed by the CLI without a traceback."""

from __future__ import annotations


class ArpoError(Exception):
    """An error caused by user input or the environment, not by a bug in arpo.

    The CLI prints ``message`` and ``hint`` on one line each and exits non-zero; ``--verbose`` adds the traceback.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ConfigError(ArpoError, ValueError):
    """An invalid configuration value or an unknown configuration key (raised at construction, naming the key)."""


class MissingDataError(ArpoError, FileNotFoundError):
    """A data file or model folder that is not there; the hint names the command that fetches it."""
