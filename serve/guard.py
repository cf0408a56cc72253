"""The checks every HTTP request passes before a route sees it (docs/security.md is the threat model).

In order: the ``Host`` header must name this server (a DNS-rebinding page cannot reach it), an ``Origin`` header must
be the served origin itself (no other site's page can call the API), every route but the page (``/``) and ``/health``
needs ``Authorization: Bearer KEY`` when a key is set, a POST body must be ``application/json`` (a plain HTML form
cannot send a request) and at most ``max_body_bytes``. Every refusal is an OpenAI-shaped JSON error, counted once in
the metrics, and nothing behind it runs. Every response carries ``nosniff`` and may not be framed.

The path judged is the one the router sees (Starlette's route path: the request path without the mount's root path),
so no mount can put a route outside the checks; and the application serves only at the root: a request reaching it
under a route prefix is refused. A security header given twice, and any scope but HTTP (a websocket), are refused.

The key never travels as a deployment argument: a replica reads it from ``ARPO_API_KEY`` or from a key file.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from arpo_base.errors import ConfigError

KEY_ENV = "ARPO_API_KEY"
#: The administration key (``arpo serve --admin-key``): it alone may change the agents; never the chat key.
ADMIN_KEY_ENV = "ARPO_ADMIN_KEY"
#: The rewards key (``arpo serve --rewards-key``): it alone may post episode rewards; never the chat or admin key.
REWARDS_KEY_ENV = "ARPO_REWARDS_KEY"
MAX_BODY_BYTES = 4 * 1024 * 1024
REQUEST_TIMEOUT_S = 300.0
#: How long a client may take to send its request body: it is read in full, under this deadline, before the request
#: takes an admission slot (an idle or trickling client holds no slot and is answered 408).
BODY_TIMEOUT_S = 10.0
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
#: Headers on every response: no MIME sniffing, no framing (clickjacking), no referrer to other sites.
COMMON_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"}
API_CSP = "default-src 'none'; frame-ancestors 'none'"


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_key(key_file: str | None, env: str = KEY_ENV) -> str | None:
    """The API key: the key file's content when one is named, else the variable ``env``, else None."""
    if key_file:
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(
                f"cannot read the API key file: {e.strerror}",
                hint="give a readable file holding the key (or set ARPO_API_KEY)",
            ) from None
        if not key:
            raise ConfigError("the API key file is empty", hint="write the key into it (one line)")
        return key
    return os.environ.get(env, "").strip() or None


@dataclass
class Security:
    """What a deployment enforces. Plain data that travels to the replicas: it names a key file, never the key.

    Attributes:
        key_file: A file holding the API key; None: the replica reads ``ARPO_API_KEY``.
        allow_unauthenticated: Serve without a key (only when none is found; a key found is always enforced).
        allowed_hosts: Accepted ``Host`` values (``name`` or ``name:port``) beside the loopback names.
        port: The port clients connect to (the ``Host`` header carries it).
        tls: Whether the proxy serves HTTPS (the served origin is then ``https://``).
        max_body_bytes: Largest request body (HTTP 413 beyond).
        request_timeout_s: Deadline of one request, tool calls included (HTTP 504 beyond).
        checks: False only to measure what the checks cost (``benchmarks/bench_serve.py``); no CLI flag sets it.
        admin_key_file: A file holding the administration key (:data:`ADMIN_PATHS` need it); None: no such file,
            and live changes are off (``ARPO_ADMIN_KEY`` is read only by ``arpo serve``, which writes this file).
        rewards_key_file: A file holding the rewards key (:data:`REWARDS_PATHS` need it); None: rewards by API are off
            (``ARPO_REWARDS_KEY`` is read only by ``arpo serve``, which writes this file).
    """

    key_file: str | None = None
    allow_unauthenticated: bool = False
    allowed_hosts: list[str] = field(default_factory=list)
    port: int = 8000
    tls: bool = False
    max_body_bytes: int = MAX_BODY_BYTES
    request_timeout_s: float = REQUEST_TIMEOUT_S
    checks: bool = True
    admin_key_file: str | None = None
    rewards_key_file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> str | None:
        """The key this deployment enforces; raises :class:`ConfigError` when one is required and none is set."""
        key = read_key(self.key_file)
        if key is None and not self.allow_unauthenticated and self.checks:
            raise ConfigError(
                "no API key: set ARPO_API_KEY (or name a key file) before starting the server",
                hint="`export ARPO_API_KEY=$(openssl rand -hex 32)`; or, on a trusted machine only, "
                "allow_unauthenticated: true",
            )
        return key

    def admin_key(self) -> str | None:
        """The administration key, or None (live changes off). Refused when it is the chat key: whoever may chat
        must not thereby be able to change what is served."""
        if not self.admin_key_file:
            return None
        admin = read_key(self.admin_key_file)
        if hmac.compare_digest(admin.encode(), (read_key(self.key_file) or "").encode()):
            raise ConfigError(
                "the admin key is the API key: administration needs a credential of its own",
                hint="`export ARPO_ADMIN_KEY=$(openssl rand -hex 32)`",
            )
        return admin

    def rewards_key(self) -> str | None:
        """The rewards key, or None (rewards by API off). Refused when it is the chat key or the admin key: a client
        that may chat must not thereby be able to reward its own episodes."""
        if not self.rewards_key_file:
            return None
        rewards = read_key(self.rewards_key_file)
        for other, name in ((read_key(self.key_file), "API key"), (self.admin_key(), "admin key")):
            if hmac.compare_digest(rewards.encode(), (other or "").encode()):
                raise ConfigError(
                    f"the rewards key is the {name}: rewards need a credential of their own",
                    hint="`export ARPO_REWARDS_KEY=$(openssl rand -hex 32)`",
                )
        return rewards

    def hosts(self) -> frozenset[str]:
        # Loopback names are always accepted: only a client on this machine sends them (a rebinding page sends its
        # own name), so they never open the server to another site.
        names = [*LOOPBACK_NAMES, *(h.lower() for h in self.allowed_hosts)]
        default_port = 443 if self.tls else 80
        out = set()
        for name in names:
            if re.search(r":\d+$", name) and not name.endswith("]"):
                out.add(name)
            else:
                out.add(f"{name}:{self.port}")
                if self.port == default_port:
                    out.add(name)
        return frozenset(out)


def page_csp(html: str) -> str:
    """A Content-Security-Policy for the chat page: its own inline script and style (by hash) and same-origin
    fetches only; nothing may frame it."""

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    return (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
        "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


#: Routes reachable without the key: the chat page (it asks for the key itself) and the liveness probe.
OPEN_PATHS = frozenset({"/", "/health"})
#: Routes that change or describe what is served: the administration key only (the chat key never opens them), and
#: refused (403) on a server started without one.
ADMIN_PATHS = frozenset({"/v1/agents"})
#: Routes that post episode rewards: the rewards key only (neither the chat nor the admin key opens them), and refused
#: (403) on a server started without one.
REWARDS_PATHS = frozenset({"/v1/rewards"})
#: Headers the checks read: one of each, or the request is refused (two values would leave the choice to whichever
#: layer reads them, "first wins" here and "last wins" there).
SINGLE_HEADERS = ("host", "origin", "authorization", "content-type", "content-length", "transfer-encoding")


def route_path(scope: dict) -> str:
    """The path the application's router matches (Starlette's own rule, so the guard judges exactly what is routed)."""
    from starlette._utils import get_route_path

    return get_route_path(scope)


class Refusal(Exception):
    """A request refused before any route runs."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}

    def body(self) -> bytes:
        return json.dumps(
            {"error": {"message": self.message, "type": "invalid_request_error", "param": None, "code": self.code}}
        ).encode()


class Policy:
    """The checks of one replica (built from :class:`Security` inside it)."""

    def __init__(self, security: Security, on_refusal: Any = None, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.enabled = security.checks
        self.open_paths = open_paths  # routes reachable without the key; every other route needs it
        self.key = security.key()
        self.admin_key = security.admin_key()
        self.rewards_key = security.rewards_key()
        self.hosts = security.hosts()
        self.scheme = "https" if security.tls else "http"
        self.max_body = security.max_body_bytes
        self.on_refusal = on_refusal

    def authorized(self, headers: dict[str, str]) -> bool:
        """Whether the request carries the key (always true without one). Constant-time comparison."""
        return self.key is None or _bearer(headers, self.key)

    def admin_authorized(self, headers: dict[str, str]) -> bool:
        """Whether the request carries the administration key (never true without one). Constant-time."""
        return self.admin_key is not None and _bearer(headers, self.admin_key)

    def check(self, method: str, path: str, headers: dict[str, str], root_path: str = "") -> None:
        """Raise :class:`Refusal` for a request that must not reach a route (``path``: the routed path)."""
        if root_path:
            raise Refusal(
                500,
                "this application is served only at the root: deploy it with route_prefix '/' (a "
                f"prefix such as {root_path!r} is refused)",
                "route_prefix_refused",
            )
        host = headers.get("host", "").lower()
        if host not in self.hosts:
            # The accepted names are not listed: a rebinding page can read this answer.
            raise Refusal(
                403,
                f"Host {host!r} is not served here: use localhost, 127.0.0.1 or a name the server "
                "allows (arpo serve --allowed-hosts)",
                "host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and origin.lower() != f"{self.scheme}://{host}":
            raise Refusal(403, f"cross-origin requests are refused (Origin {origin!r})", "origin_not_allowed")
        if path in ADMIN_PATHS:
            self.check_admin(headers)
        elif path in REWARDS_PATHS:
            self.check_rewards(headers)
        elif path not in self.open_paths and not self.authorized(headers):
            raise Refusal(
                401,
                "Incorrect or missing API key: send the header 'Authorization: Bearer KEY'",
                "invalid_api_key",
                {"WWW-Authenticate": "Bearer"},
            )
        if method == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                raise Refusal(
                    415,
                    f"the request body must be application/json, got {ctype or 'no Content-Type'!r}",
                    "unsupported_media_type",
                )
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                raise self.too_large()

    def check_admin(self, headers: dict[str, str]) -> None:
        """Raise :class:`Refusal` unless the request carries the administration key: 403 on a server without one
        (live changes are off), 401 for any other credential, the chat key included."""
        _own_key(self.admin_key, headers, "live agent changes", "--admin-key", "admin")

    def check_rewards(self, headers: dict[str, str]) -> None:
        """Raise :class:`Refusal` unless the request carries the rewards key: 403 on a server without one, 401 for
        any other credential (the chat and admin keys included)."""
        _own_key(self.rewards_key, headers, "rewards by API", "--rewards-key", "rewards")

    def too_slow(self) -> Refusal:
        return Refusal(
            408,
            f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
            "request_timeout",
            {"Connection": "close"},
        )

    def too_large(self) -> Refusal:
        return Refusal(413, f"the request body exceeds {self.max_body} bytes", "request_too_large")


def _own_key(key: str | None, headers: dict[str, str], what: str, flag: str, name: str) -> None:
    """The check of a route with a key of its own: 403 when the server has none, 401 for any other credential."""
    if key is None:
        raise Refusal(403, f"{what} are off on this server (arpo serve {flag} enables them)", f"{name}_disabled")
    if not _bearer(headers, key):
        raise Refusal(
            401,
            f"Incorrect or missing {name} key: send the header 'Authorization: Bearer {name.upper()}_KEY'",
            f"invalid_{name}_key",
            {"WWW-Authenticate": "Bearer"},
        )


_POLICY: list[Policy] = []  # the replica's policy, installed by its constructor before any request is served


def install(policy: Policy) -> None:
    _POLICY[:] = [policy]


def count_fault(status: int) -> None:
    """Count an answer the routes could not count themselves (the app's backstop for an uncaught fault) once, as
    the replica's refusals are counted (``model="-"``)."""
    if _POLICY and _POLICY[0].on_refusal is not None:
        _POLICY[0].on_refusal(status)


class _BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware applying the replica's :class:`Policy` (installed with :func:`install`)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # the application's own start and stop, not a request
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no route serves another protocol: refused before anything reads it
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "only HTTP is served here"})
            return
        if not _POLICY:  # the constructor has not run: refuse rather than serve unchecked
            await _send_refusal(send, Refusal(503, "the server is starting", "loading", {"Retry-After": "1"}))
            return
        policy = _POLICY[0]
        started = False

        async def send_with_headers(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                present = {k.lower() for k, _ in message.get("headers", [])}
                extra = dict(COMMON_HEADERS, **{"Content-Security-Policy": API_CSP})
                message = dict(
                    message,
                    headers=[
                        *message.get("headers", []),
                        *(
                            (k.lower().encode(), v.encode())
                            for k, v in extra.items()
                            if k.lower().encode() not in present
                        ),
                    ],
                )
            await send(message)

        if not policy.enabled:
            await self.app(scope, receive, send_with_headers)
            return
        try:
            headers = single_headers(scope["headers"])
            policy.check(scope["method"], route_path(scope), headers, scope.get("root_path", ""))
        except Refusal as r:
            await _refuse(policy, send_with_headers, r)
            return
        seen = 0

        async def bounded_receive() -> dict:  # a body without (or beyond) its Content-Length is cut at the limit
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > policy.max_body:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, bounded_receive, send_with_headers)
        except _BodyTooLarge:
            if started:
                raise
            await _refuse(policy, send_with_headers, policy.too_large())


def single_headers(raw: list) -> dict[str, str]:
    """The request's headers by lower-case name; a header of :data:`SINGLE_HEADERS` given twice is refused (400)."""
    headers: dict[str, str] = {}
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name in headers and name in SINGLE_HEADERS:
            raise Refusal(400, f"the header {name!r} is given more than once", "duplicate_header")
        headers[name] = v.decode("latin-1")
    return headers


async def _refuse(policy: Policy, send: Any, r: Refusal) -> None:
    if policy.on_refusal is not None:
        policy.on_refusal(r.status)
    await _send_refusal(send, r)


def _bearer(headers: dict[str, str], key: str) -> bool:
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


async def _send_refusal(send: Any, r: Refusal) -> None:
    body = r.body()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in r.headers.items()),
    ]
    await send({"type": "http.response.start", "status": r.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def refuse_route_prefix() -> None:
    """Refuse (:class:`ConfigError`, so the deployment fails and ``serve run``/``serve deploy`` report it) to start a
    replica of an application mounted anywhere but at the root.

    Invariant: the application is reachable only at ``/``, where the proxy's gate and the guard judge every path as
    routed; a prefix is refused before any route exists, and the guard still refuses each request under one."""
    from ray import serve
    from ray.serve.context import _get_global_client

    app = serve.get_replica_context().app_name
    details = _get_global_client().get_serve_details()
    prefix = ((details.get("applications") or {}).get(app) or {}).get("route_prefix")
    if prefix not in (None, "/"):
        raise ConfigError(
            f"the arpo application {app!r} is deployed with route_prefix {prefix!r}: it is served only at the root",
            hint="set route_prefix: / in the Serve config (one arpo application per Serve instance)",
        )
