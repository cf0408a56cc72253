"""The answer Ray Serve's HTTP proxy gives for a request whose replica was lost: an OpenAI-shaped 503 + Retry-After.

The proxy hands each request to one replica and relays that replica's ASGI messages. When the replica's actor dies
while it holds the request (its node lost, its process killed), the proxy's call fails with Ray's ``RayActorError``
(``ActorDiedError``, ``ActorUnavailableError``); Serve maps it to a 500 but sends nothing itself (it answers only 408,
429 and 503 on its own), so uvicorn closes the exchange with its plain-text ``500 Internal Server Error``, and a stream
already under way just stops, without its end. The router drops that replica from then on and the controller replaces
it, so for the client the loss is transient, like a full replica.

:class:`LostReplica` wraps the proxy (Serve applies the middlewares that :data:`PROXY_CALLBACK_ENV` names; the
controller's environment carries the name to its proxies, :func:`controller_options`). Invariant: the application
answers every request it runs (its routes and its backstop turn every fault into an OpenAI-shaped JSON answer), so a
proxy that returns without a response start never reached a live application: that request gets the same answer and
count as one the replica's admission refuses, 503 ``server_error`` with ``Retry-After``. A server-sent-event stream
cut off before its end gets the error event the application sends for a failure mid-stream, then ends; its 200
status line has gone out and cannot change. This is no liveness check of its own: whether a replica is alive is the
router's and the controller's business (Serve's health checks and the application's ``check_health``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

#: Serve's proxy calls the function at this import path (in the proxy's process) for its extra ASGI middlewares.
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "serve.proxy.middlewares"
#: Retry-After of the answer: the replica's admission default (a replacement replica takes longer, and says so with
#: its own 503 + Retry-After while its agents load).
RETRY_AFTER_S = 1.0
MESSAGE = "the server replica that had this request was lost; retry shortly"
log = logging.getLogger("arpo.serve")


def error_body() -> dict[str, Any]:
    from serve.schema import APIError

    return APIError(MESSAGE, status=503, type="server_error", code="replica_lost").body()


class _Count:
    """``arpo_serve_requests_total{model="-", status=...}`` from the proxy's process (created on first use)."""

    metrics: Any = None

    @classmethod
    def lost(cls, seconds: float) -> None:
        cls.status("503", seconds)

    @classmethod
    def status(cls, status: str, seconds: float) -> None:
        try:
            if cls.metrics is None:
                from serve.metrics import ServeMetrics

                cls.metrics = ServeMetrics()
            cls.metrics.request("-", status, seconds)
        except Exception as e:  # noqa: BLE001 - a metric must never cost the client its answer
            log.warning("counting a lost replica's request failed: %s", e)


class LostReplica:
    """ASGI middleware around Serve's HTTP proxy: a request the proxy ends without an answer gets a 503 + Retry-After,
    a server-sent-event stream it cuts off gets an error event and its end (see the module's docstring)."""

    def __init__(self, app: Any, retry_after_s: float = RETRY_AFTER_S) -> None:
        self.app, self.retry_after = app, str(max(1, math.ceil(retry_after_s)))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        state = {"started": False, "ended": False, "sse": False, "gone": False}

        async def watch_receive() -> dict:
            message = await receive()
            if message["type"] == "http.disconnect":
                state["gone"] = True
            return message

        async def watch_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = dict(message.get("headers") or [])
                state["sse"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, watch_receive, watch_send)
        except Exception as e:  # noqa: BLE001 - Serve's proxy failing itself: answered below like a lost replica
            log.warning("Serve's proxy failed on a request: %s", e)
        if state["gone"] or state["ended"]:  # answered in full, or nobody to answer
            return
        body = error_body()
        if not state["started"]:
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"retry-after", self.retry_after.encode()),
                        (b"x-content-type-options", b"nosniff"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": json.dumps(body).encode()})
        elif state["sse"]:
            await send({"type": "http.response.body", "body": f"data: {json.dumps(body)}\n\n".encode()})
        else:  # a JSON answer cut off mid-body: leave it unterminated (the server closes the connection), never
            return  # let a client take half a body for a whole one
        _Count.lost(time.perf_counter() - t0)


#: The deployment's :class:`serve.guard.Security` as JSON (it names a key file, never the key), for :class:`Gate`.
SECURITY_ENV = "ARPO_SERVE_PROXY_SECURITY"
#: Ray Serve reads these request headers from the client (``x-request-timeout-seconds: 0`` turns its request timeout
#: off, ``x-request-disconnect-disabled`` its disconnect handling): the gate removes every ``x-request-*`` header.
CLIENT_CONTROL_PREFIX = b"x-request-"


class Gate:
    """ASGI middleware in front of Serve's proxy: limits that must hold before the proxy queues a request.

    Invariant: no request reaches Serve's routing (and so no replica's queue or slot) unless its Host, Origin, key and
    Content-Type pass the replica's own checks (:class:`serve.guard.Policy`, built from :data:`SECURITY_ENV`), its
    client-controlled ``x-request-*`` headers are gone, and its whole body has arrived within
    :data:`serve.guard.BODY_TIMEOUT_S` and within the body limit; the gate reads at most the limit plus one chunk.
    A scope other than HTTP (a websocket) is refused here too. Without :data:`SECURITY_ENV` (a proxy that
    ``arpo serve`` did not start) the header stripping, the body limit and the body deadline still hold, and the
    replicas check the rest."""

    def __init__(self, app: Any) -> None:
        self.app, self.policy = app, None
        from serve.guard import MAX_BODY_BYTES, Policy, Security

        self.max_body = MAX_BODY_BYTES
        text = os.environ.get(SECURITY_ENV)
        if text:
            self.policy = Policy(Security(**json.loads(text)))
            self.max_body = self.policy.max_body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        import asyncio

        from serve.guard import BODY_TIMEOUT_S, Refusal, route_path, single_headers

        if scope["type"] == "lifespan":  # the proxy's own start and stop, not a request
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no route serves another protocol: refused before Serve routes it to a replica
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "only HTTP is served here"})
            return
        t0 = time.perf_counter()
        scope = dict(
            scope, headers=[(k, v) for k, v in scope["headers"] if not k.lower().startswith(CLIENT_CONTROL_PREFIX)]
        )
        try:
            headers = single_headers(scope["headers"])
            if self.policy is not None and self.policy.enabled:
                self.policy.check(scope["method"], route_path(scope), headers, scope.get("root_path", ""))
            body = await asyncio.wait_for(self._body(receive, headers), BODY_TIMEOUT_S)
        except TimeoutError:
            await self._refuse(
                send,
                Refusal(
                    408,
                    f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                    "request_timeout",
                    {"Connection": "close"},
                ),
                t0,
            )
            return
        except Refusal as r:
            await self._refuse(send, r, t0)
            return
        if body is None:  # the client went away while sending
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _body(self, receive: Any, headers: dict[str, str]) -> bytes | None:
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise self._too_large()
        parts, seen = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body:
                raise self._too_large()
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def _too_large(self) -> Any:
        from serve.guard import Refusal

        return Refusal(
            413, f"the request body exceeds {self.max_body} bytes", "request_too_large", {"Connection": "close"}
        )

    async def _refuse(self, send: Any, r: Any, t0: float) -> None:
        from serve.guard import _send_refusal

        _Count.status(str(r.status), time.perf_counter() - t0)
        await _send_refusal(send, r)


def middlewares() -> list:
    """The proxy's extra middlewares (the function :data:`PROXY_CALLBACK` names), each wrapping the one before it
    (Serve wraps its own request-id middleware first, then these in order): the gate before Serve's proxy code, so a
    request it refuses never reaches Serve's routing, and the lost-replica answer outermost. The gate is left out
    only for a :class:`serve.guard.Security` whose checks are off (what the serving benchmark compares against; no
    command-line flag or deployment argument sets it)."""
    from starlette.middleware import Middleware

    text = os.environ.get(SECURITY_ENV)
    if text and json.loads(text).get("checks") is False:
        return [Middleware(LostReplica)]
    return [Middleware(Gate), Middleware(LostReplica)]


def controller_options(security: Any = None) -> dict[str, Any]:
    """``serve.start(controller_options=...)``: Serve's controller, and the proxies it starts (they inherit its
    environment), load :func:`middlewares`; ``security`` (a :class:`serve.guard.Security`) is what their gate
    enforces. Takes effect when Serve starts, not on a Serve already running."""
    env = {PROXY_CALLBACK_ENV: PROXY_CALLBACK}
    if security is not None:
        env[SECURITY_ENV] = json.dumps(security.to_dict())
    return {"runtime_env": {"env_vars": env}}
