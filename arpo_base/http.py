"""The one HTTP client of the project, on ``requests``: :func:`get_json`, :func:`post_json`, :func:`request` and
:func:`download`.

A request sends its payload as JSON (``Content-Type: application/json``) and reads the reply as JSON. Anything that
is not a 2xx JSON reply raises :class:`HTTPJSONError`, which names the method, the URL and the status (or, when no
answer came at all, the socket's reason) and keeps the reply's text for the caller's own message. It is an
``OSError``, so code that treats network failures as ``OSError`` keeps doing so.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_TIMEOUT", "HTTPJSONError", "Reply", "bearer", "download", "get_json", "post_json", "request"]

DEFAULT_TIMEOUT = 30.0
#: Characters of a reply's text that an error message quotes (the whole text stays on the exception).
QUOTED = 300


@dataclass(frozen=True)
class Reply:
    """A 2xx JSON reply: its status, headers (as sent, first spelling of each name) and decoded body."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    data: Any = None


class HTTPJSONError(OSError):
    """A request that got no 2xx JSON reply.

    Attributes:
        method, url: What was asked.
        status: The HTTP status, or None when no answer came (connection refused, timeout, unknown host).
        reason: The status's reason phrase, the socket error, or why the body is not JSON.
        body: The reply's text ("" when no answer came).
        headers: The reply's headers ({} when no answer came).
        data: The reply's body decoded as JSON, when it is JSON (error replies of JSON APIs are), else None.
    """

    def __init__(
        self,
        method: str,
        url: str,
        status: int | None,
        reason: str,
        body: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.method, self.url, self.status, self.reason, self.body = method, url, status, reason, body
        self.headers = headers or {}
        try:
            self.data = json.loads(body) if body else None
        except ValueError:
            self.data = None
        where = f"{method} {url}"
        message = f"{where}: HTTP {status} {reason}" if status is not None else f"{where}: no answer ({reason})"
        super().__init__(message + (f": {body[:QUOTED]}" if body else ""))

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its own fields (OSError would pass only the message), so it survives pickling (Ray).
        return type(self), (self.method, self.url, self.status, self.reason, self.body, self.headers)


def bearer(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header of a bearer token ({} when there is none)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def request(
    method: str,
    url: str,
    payload: Any = None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    raw: bytes | None = None,
    verify: bool = True,
) -> Reply:
    """Send ``payload`` as JSON (or ``raw`` bytes as they are, e.g. a malformed body a server must refuse) and return
    the decoded 2xx reply; raises :class:`HTTPJSONError` otherwise. ``verify=False`` accepts any TLS certificate
    (only for polling one's own server on this machine)."""
    import requests

    data = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else None)
    sent = {"Content-Type": "application/json", **(headers or {})}
    try:
        with warnings.catch_warnings():  # verify=False is asked for knowingly: no warning per poll
            warnings.simplefilter("ignore", requests.packages.urllib3.exceptions.InsecureRequestWarning)
            resp = requests.request(
                method, url, data=data, headers=sent, timeout=timeout, verify=verify, allow_redirects=False
            )
        status, got, text = resp.status_code, dict(resp.headers), resp.content.decode(errors="replace")
    except requests.RequestException as e:  # no answer: refused, reset, timed out, unknown host, TLS failure
        raise HTTPJSONError(method, url, None, _reason(e)) from None
    if not 200 <= status < 300:
        raise HTTPJSONError(method, url, status, resp.reason or "", text, got)
    try:
        return Reply(status, got, json.loads(text))
    except ValueError as e:
        raise HTTPJSONError(method, url, status, f"reply is not JSON ({e})", text, got) from None


def _reason(e: Exception) -> str:
    """The innermost cause of a failed request (``Connection refused``, ``timed out``), not requests' whole chain."""
    cause: BaseException = e
    while cause.__context__ is not None and cause.__context__ is not cause:
        cause = cause.__context__
    return str(cause) or type(cause).__name__


def download(url: str, dest: str, *, timeout: float = DEFAULT_TIMEOUT, headers: dict[str, str] | None = None) -> None:
    """Stream ``GET url`` into the file ``dest``, decoded as the server's Content-Encoding says; raises
    :class:`HTTPJSONError` (an ``OSError``) on any failure, and then leaves no partial ``dest`` behind."""
    import requests

    written = False
    try:
        with requests.get(url, headers=headers, timeout=timeout, stream=True) as resp:
            if not 200 <= resp.status_code < 300:
                raise HTTPJSONError("GET", url, resp.status_code, resp.reason or "", resp.text[:QUOTED])
            with open(dest, "wb") as f:
                written = True
                for chunk in resp.iter_content(chunk_size=1 << 20):
                    f.write(chunk)
    except BaseException as e:
        if written:  # only the file this call began; a failed request leaves an older file as it was
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest)
        if isinstance(e, requests.RequestException):
            raise HTTPJSONError("GET", url, None, _reason(e)) from None
        raise


def get_json(url: str, *, headers: dict[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """``GET url`` -> the decoded JSON body; raises :class:`HTTPJSONError`."""
    return request("GET", url, headers=headers, timeout=timeout).data


def post_json(
    url: str, payload: Any, *, headers: dict[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT
) -> Any:
    """``POST url`` with ``payload`` as JSON -> the decoded JSON body; raises :class:`HTTPJSONError`."""
    return request("POST", url, payload, headers=headers, timeout=timeout).data
