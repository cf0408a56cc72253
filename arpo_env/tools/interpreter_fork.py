"""A session's copy of a persistent interpreter when the fork cannot be made: the one trajectory fails, not its tree."""

from __future__ import annotations

from typing import Any

from arpo_env.tools.base import ToolResult
from arpo_env.tools.interpreter import ForkError


class Failed:
    """A fork that could not be made: every call raises its error (the trajectory ends with it)."""

    persistent, started, fork_s = True, False, None

    def __init__(self, error: ForkError) -> None:
        self.error = error

    def __call__(self, **_: Any) -> ToolResult:
        raise self.error

    def fork(self) -> Failed:
        return self

    def close(self) -> None:
        pass


def fork_or_failure(interp: Any) -> Any:
    """``interp.fork()``, or a stand-in that raises the ForkError at the copy's next call (a session's clone must
    not fail the caller's whole tree; the one trajectory fails instead)."""
    try:
        return interp.fork()
    except ForkError as exc:
        return Failed(exc)
