"""The error every refused request raises: an HTTP status and OpenAI's error fields."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the server refuses, with the HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:  # noqa: A002
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
