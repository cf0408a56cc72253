"""The serve side's access checks against a real server (tests/serve/guarded.py): Ray Serve on 127.0.0.1 with an API
key, the official ``openai`` client where it fits and raw HTTP where a client would not send the request (a wrong
Host, a foreign Origin, a form post).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

from tests.serve.guarded import (
    KEY,
    assert_openai_error,
    chat_body,
    post_chat,
    request,
    server_fixture,
    status_counts,
)

openai = pytest.importorskip("openai")

server = server_fixture(sleeper=False)


# ------------------------------------------------------------------------------------------------- authentication
def test_v1_needs_the_key_and_health_says_only_up(server):
    url = server["url"]
    for key in ("", "wrong-key", KEY + "x"):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key or "none", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as e:
            client.models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    status, headers, out = post_chat(server, chat_body(), headers={"Authorization": None})
    assert status == 401 and headers.get("www-authenticate") == "Bearer"
    assert_openai_error(out, "invalid_api_key")
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    assert (
        good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        .choices[0]
        .message.content
        is not None
    )
    assert request(server, "GET", "/health", headers={"Authorization": None})[2] == {"status": "ok"}
    assert request(server, "GET", "/health")[2] == {"status": "ok", "models": ["tiny"]}
    status, headers, page = request(server, "GET", "/", headers={"Authorization": None})
    assert status == 200 and "<title>arpo serve</title>" in page


def test_models_and_errors_name_no_path(server):
    status, _, out = request(server, "GET", "/v1/models")
    text = json.dumps(out)
    assert status == 200 and str(server["model"]) not in text and "/" not in text.replace("\\/", ""), text
    status, _, out = post_chat(server, chat_body(model="nope"))
    assert status == 404 and str(server["model"]) not in json.dumps(out)


def test_exposed_bind_without_key_or_hosts_is_refused_before_anything_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ARPO_API_KEY"}
    cmd = [sys.executable, "-m", "arpo_algo.cli", "serve", str(tmp_path / "no-model"), "--host", "0.0.0.0"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert "without an API key" in r.stderr and "ARPO_API_KEY" in r.stderr, r.stderr
    assert "Ray" not in r.stderr + r.stdout and time.monotonic() - t0 < 60  # refused before Ray or a model
    r = subprocess.run(cmd, capture_output=True, text=True, env={**env, "ARPO_API_KEY": KEY}, timeout=120)
    assert r.returncode == 2 and "--allowed-hosts" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_config_files_take_the_key_from_the_environment_or_a_file_never_from_args(tmp_path, monkeypatch):
    from arpo_base.errors import ConfigError
    from serve.app import security_from_args

    monkeypatch.delenv("ARPO_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="no API key"):
        security_from_args({"models": "x"})
    with pytest.raises(ConfigError, match="must not be a deployment argument"):
        security_from_args({"api_key": KEY, "allow_unauthenticated": "true"})
    assert security_from_args({"allow_unauthenticated": "true"}).key() is None
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    assert security_from_args({"key_file": str(key_file)}).key() == KEY
    monkeypatch.setenv("ARPO_API_KEY", KEY)
    sec = security_from_args({"allowed_hosts": "gpu1.example.org", "port": "9000"})
    assert sec.key() == KEY and KEY not in json.dumps(sec.to_dict())
    assert {"gpu1.example.org:9000", "localhost:9000", "127.0.0.1:9000"} <= sec.hosts()


def test_the_config_file_deploys_only_with_a_key(server, monkeypatch):
    """examples/serve_config.yaml's args through the builder Serve calls: no key -> refused; ARPO_API_KEY set ->
    an application whose deployment arguments do not hold the key."""
    import yaml

    from arpo_base.errors import ConfigError
    from serve.app import build

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "examples", "serve_config.yaml"), encoding="utf-8") as f:
        args = dict(yaml.safe_load(f)["applications"][0]["args"], models=f"tiny={server['model']}")
    monkeypatch.delenv("ARPO_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="no API key"):
        build(args)
    monkeypatch.setenv("ARPO_API_KEY", KEY)
    from ray import cloudpickle

    assert KEY.encode() not in cloudpickle.dumps(build(args))  # what Serve ships and stores of the application


# ----------------------------------------------------------------------------------------- browser-borne attacks
def test_post_bodies_only_as_json(server):
    body = json.dumps(chat_body()).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        status, _, out = post_chat(server, body, headers={"Content-Type": ctype})
        assert status == 415, (ctype, out)
        assert_openai_error(out, "unsupported_media_type")
    assert post_chat(server, body, headers={"Content-Type": "application/json; charset=utf-8"})[0] == 200


def test_host_must_name_this_server(server):
    port = server["port"]
    for host in (f"evil.example:{port}", "127.0.0.1:1", "localhost", "attacker.test"):
        status, _, out = request(server, "GET", "/v1/models", headers={"Host": host})
        assert status == 403, (host, out)
        assert_openai_error(out, "host_not_allowed")
    assert request(server, "GET", "/", headers={"Host": f"evil.example:{port}"})[0] == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert request(server, "GET", "/v1/models", headers={"Host": host})[0] == 200, host


def test_foreign_origins_are_refused(server):
    port = server["port"]
    for origin in ("http://evil.example", "null", f"http://localhost:{port + 1}", f"https://127.0.0.1:{port}"):
        status, _, out = post_chat(server, chat_body(), headers={"Origin": origin})
        assert status == 403, (origin, out)
        assert_openai_error(out, "origin_not_allowed")
    assert post_chat(server, chat_body(), headers={"Origin": f"http://127.0.0.1:{port}"})[0] == 200


def test_page_is_locked_down_and_its_script_allowed(server):
    import base64
    import hashlib
    import re

    status, headers, page = request(server, "GET", "/", headers={"Authorization": None})
    csp = headers["content-security-policy"]
    assert status == 200 and "frame-ancestors 'none'" in csp and "default-src 'none'" in csp
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp, "the page's own script must be allowed by hash"
    assert not re.search(r"\sstyle=", page) and not re.search(r"\son[a-z]+=", page), "inline attributes are blocked"
    assert "sessionStorage" in page and "localStorage" not in page
    api_headers = request(server, "GET", "/v1/models")[1]
    assert "frame-ancestors 'none'" in api_headers["content-security-policy"]


def test_the_key_is_never_logged(server):
    """Nothing Ray, Serve or the replica wrote (access logs, replica logs) holds the key."""
    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    assert os.path.isdir(logs)
    holding = []
    for folder, _, files in os.walk(logs):
        for name in files:
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    if KEY.encode() in f.read():
                        holding.append(name)
            except OSError:
                continue
    assert holding == []


def test_refusals_are_counted_once(server):
    before, deadline = status_counts(server), time.monotonic() + 60
    while time.monotonic() < deadline:  # earlier tests' counts may still be on their way to the export
        time.sleep(2.5)
        now = status_counts(server)
        if now == before:
            break
        before = now
    sent = {"401": 2, "415": 3, "403": 1, "400": 1, "413": 1}
    for _ in range(sent["401"]):
        post_chat(server, chat_body(), headers={"Authorization": "Bearer nope"})
    for _ in range(sent["415"]):
        post_chat(server, json.dumps(chat_body()).encode(), headers={"Content-Type": "text/plain"})
    post_chat(server, chat_body(), headers={"Origin": "null"})
    post_chat(server, chat_body(stop=["x"] * 5))
    post_chat(server, b" " * (5 << 20))
    want = {k: before.get(k, 0.0) + v for k, v in sent.items()}
    deadline, now = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        now = status_counts(server)
        if all(now.get(k, 0.0) >= v for k, v in want.items()):
            break
        time.sleep(1)
    time.sleep(3)  # a second export of the same counters must not add to them
    now = status_counts(server)
    assert {k: now.get(k, 0.0) for k in want} == want, (before, now)


def test_a_load_failure_says_its_cause_and_no_traceback():
    """What `arpo serve` prints when an agent does not load: the error's own message (and hint), not only its type."""
    from arpo_base.errors import ConfigError
    from serve.app import load_failure

    said = load_failure(ConfigError("runs/x is not a model source", hint="pass a model folder"))
    assert said == "runs/x is not a model source (hint: pass a model folder)"
    said = load_failure(ValueError("Unrecognized model in runs/x. Should have a `model_type` key"))
    assert said.startswith("ValueError: Unrecognized model in runs/x") and "Traceback" not in said


# ------------------------------------------------------------------------------------------- one mount, as routed
def raw(srv: dict, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send exactly ``head`` (request line and headers, CRLF-separated, no blank line) and ``body``; the status and
    the answer's body."""
    import socket

    with socket.create_connection(("127.0.0.1", srv["port"]), timeout=60) as s:
        s.sendall(head + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def test_every_route_but_the_page_and_health_needs_the_key(server):
    for path in ("/v1/models", "/v1", "/nope", "/metrics", "/docs", "//v1/models", "/health/x"):
        status, _, out = request(server, "GET", path, headers={"Authorization": None})
        assert status == 401, (path, out)
        assert_openai_error(out, "invalid_api_key")
    assert request(server, "GET", "/nope")[0] == 404  # with the key: the router's own answer


def test_a_route_prefix_is_refused_and_opens_nothing(server, tmp_path):
    """The same application deployed under a route prefix (as `serve run`/`serve deploy` would from a config with
    route_prefix /p): its replicas refuse to start, so the deployment fails naming the prefix and the fix, and no
    route under the prefix ever answers (before, it deployed and each request was refused with a 500)."""
    from ray import serve

    from serve.agents import build_specs
    from serve.app import build_app
    from serve.guard import Security

    specs = build_specs([f"tiny={server['model']}"], tools="python", max_tokens=4)
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    security = Security(key_file=str(key_file), port=server["port"])
    try:
        with pytest.raises(RuntimeError, match="Deploying application prefixed failed"):
            serve.run(build_app(specs, security, num_cpus=0.1), name="prefixed", route_prefix="/p", blocking=False)
        app = serve.status().applications["prefixed"]
        assert app.status == "DEPLOY_FAILED"
        why = app.deployments["arpo_agents"].message  # the replica's own error, as `serve status` shows it
        assert "route_prefix '/p'" in why and "route_prefix: /" in why, why
        for auth in (None, f"Bearer {KEY}"):
            for method, path in (("POST", "/p/v1/chat/completions"), ("GET", "/p/v1/models"), ("GET", "/p/")):
                body = json.dumps(chat_body()).encode() if method == "POST" else None
                status, _, out = request(server, method, path, body, headers={"Authorization": auth})
                assert status in (401, 404, 503), (auth, path, status, out)  # no agent behind the prefix
        assert request(server, "GET", "/health")[0] == 200  # the application at the root is untouched
    finally:
        serve.delete("prefixed")


def test_the_guard_refuses_every_request_under_a_root_path(tmp_path):
    """The second line behind the replica's refusal to start under a prefix: a request whose scope carries a root
    path is refused whatever its key, so no future mount can put a route beside the guard's view of it."""
    from serve.guard import Policy, Refusal, Security

    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    policy = Policy(Security(key_file=str(key_file)))
    headers = {"host": "127.0.0.1:8000", "authorization": f"Bearer {KEY}"}
    policy.check("GET", "/v1/models", headers)  # at the root, with the key: allowed
    for path in ("/v1/models", "/health", "/"):
        with pytest.raises(Refusal) as e:
            policy.check("GET", path, headers, root_path="/p")
        assert e.value.status == 500 and e.value.code == "route_prefix_refused"


def test_the_config_file_and_arpo_serve_mount_at_the_root():
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "examples", "serve_config.yaml"), encoding="utf-8") as f:
        assert [a["route_prefix"] for a in yaml.safe_load(f)["applications"]] == ["/"]


def test_a_security_header_given_twice_is_refused(server):
    port, good = server["port"], f"Authorization: Bearer {KEY}".encode()
    host = b"Host: 127.0.0.1:%d" % port
    body = json.dumps(chat_body()).encode()
    ctype = b"Content-Type: application/json"
    cases = {
        "host": [b"GET /v1/models HTTP/1.1", b"Host: evil.example", host, good],
        "authorization": [b"GET /v1/models HTTP/1.1", host, b"Authorization: Bearer nope", good],
        "origin": [
            b"POST /v1/chat/completions HTTP/1.1",
            host,
            good,
            ctype,
            b"Origin: http://127.0.0.1:%d" % port,
            b"Origin: http://evil.example",
        ],
        "content-type": [b"POST /v1/chat/completions HTTP/1.1", host, good, b"Content-Type: text/plain", ctype],
    }
    for name, lines in cases.items():
        status, out = raw(server, b"\r\n".join(lines), body if lines[0].startswith(b"POST") else b"")
        assert status == 400, (name, out)
        assert json.loads(out)["error"]["code"] == "duplicate_header", out
    status, out = raw(server, b"\r\n".join([b"GET /v1/models HTTP/1.1", host, good]))
    assert status == 200, out


@pytest.mark.parametrize("where", ["replica", "proxy"])
def test_non_http_scopes_are_refused_before_the_app(where, monkeypatch):
    """A websocket is closed by the replica's guard and, before Serve routes it to a replica, by the proxy's gate;
    a lifespan passes both."""
    import asyncio

    from serve.guard import Guard, Policy, Security, install
    from serve.proxy import SECURITY_ENV, Gate

    install(Policy(Security(allow_unauthenticated=True)))
    monkeypatch.delenv(SECURITY_ENV, raising=False)
    middleware = Guard if where == "replica" else Gate
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/chat/completions", "root_path": "", "headers": [], "query_string": b""}
    asyncio.run(middleware(app)(scope, receive, send))
    assert reached == [] and [m["type"] for m in sent] == ["websocket.close"], (reached, sent)
    asyncio.run(middleware(app)({"type": "lifespan"}, receive, send))
    assert reached == ["lifespan"]


def test_bodies_that_are_not_plain_json_text_are_400(server):
    """A lone surrogate escape and nesting deeper than the parser's recursion: client mistakes, answered 400."""
    lone = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    deep = (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "metadata": '
        + b"[" * 200_000
        + b"]" * 200_000
        + b"}"
    )
    for body in (
        lone,
        deep,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "user": '
        + b'{"a": ' * 40
        + b"1"
        + b"}" * 40
        + b"}",
    ):
        status, _, out = post_chat(server, body)
        assert status == 400, (body[:80], out)
        assert_openai_error(out)
        assert "Traceback" not in json.dumps(out)


def test_max_tokens_has_a_server_ceiling(server):
    from serve.agents import MAX_TOKENS_LIMIT

    status, _, out = post_chat(server, chat_body(max_tokens=MAX_TOKENS_LIMIT + 1))
    assert status == 400 and out["error"]["param"] == "max_tokens", out
    assert f"at most {MAX_TOKENS_LIMIT} on this server" in out["error"]["message"], out


# ----------------------------------------------------------------------------------------- limits before any work
def test_idle_sockets_with_the_timeout_off_header_lock_nobody_out(server):
    """More idle clients than the replica has slots and queue, each asking Serve to switch its timeout and disconnect
    handling off and sending no body: another client is answered at once; the idle ones get 408."""
    import socket

    from serve.guard import BODY_TIMEOUT_S

    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\nx-request-timeout-seconds: 0\r\n"
        b"x-request-disconnect-disabled: ?1\r\n\r\n" % (server["port"], KEY.encode())
    )
    idle = [socket.create_connection(("127.0.0.1", server["port"]), timeout=60) for _ in range(20)]
    try:
        for s in idle:
            s.sendall(head)
        time.sleep(1)
        t0 = time.monotonic()
        status, _, out = post_chat(server, chat_body(), timeout=60)
        assert status == 200 and time.monotonic() - t0 < BODY_TIMEOUT_S, out
        for s in idle:
            answer = s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        for s in idle:
            s.close()


def test_an_oversized_chunked_body_is_cut_at_the_limit(server):
    """A chunked body announces no length: the server answers 413 once the limit is passed and stops reading, so
    the client cannot push much more than the limit (the socket buffers) into it."""
    import socket
    import threading

    from serve.guard import MAX_BODY_BYTES

    s = socket.create_connection(("127.0.0.1", server["port"]), timeout=60)
    sent = [0]

    def push() -> None:
        piece = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
        try:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer %s\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" % (server["port"], KEY.encode())
            )
            for _ in range(256):
                s.sendall(piece)
                sent[0] += 1 << 20
        except OSError:
            pass  # the server answered and closed

    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    try:
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        with contextlib.suppress(OSError):  # the server may have closed the connection already
            s.shutdown(socket.SHUT_RDWR)
    finally:
        s.close()
        pusher.join(60)
    assert sent[0] < MAX_BODY_BYTES + (32 << 20), sent[0]


# ----------------------------------------------------------------------------------------------- Ray on loopback
def test_ray_started_for_a_loopback_server_listens_on_loopback_only(server):
    """Every listener of this server's Ray (GCS, raylet, workers, the metrics export, Serve's proxy) is on loopback,
    but each replica's inter-deployment gRPC server, which Ray binds to every interface with no setting to change
    it (behind Ray's token authentication); Ray's token file is readable by its owner only."""
    import ipaddress
    from pathlib import Path

    psutil = pytest.importorskip("psutil")
    listening = []
    from arpo_base.procs import descendants

    for p in descendants():
        try:
            listening += [
                (p.name(), c.laddr.ip, c.laddr.port)
                for c in p.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            ]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    ports = {port for _, _, port in listening}
    assert server["port"] in ports and server["metrics_port"] in ports, listening
    exposed = [x for x in listening if not ipaddress.ip_address(x[1].removeprefix("::ffff:")).is_loopback]
    replica_grpc = [x for x in exposed if x[0].startswith("ray::ServeReplica") and x[1] == "::"]
    assert len(replica_grpc) <= 1 and [x for x in exposed if x not in replica_grpc] == [], exposed
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if token.is_file():
        assert token.stat().st_mode & 0o077 == 0, oct(token.stat().st_mode)
