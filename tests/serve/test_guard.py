"""The serve side's security checks against a real server: Ray Serve on 127.0.0.1 with an API key, a tiny untrained
model with the python tool, the official ``openai`` client where it fits and raw HTTP where a client would not send
the request (a wrong Host, a form post, an oversized body).

The last test stops the replica's engines, so it stays last in this module.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

KEY = "test-key-0123456789abcdef"
APP = "arpo-guard"
TIMEOUT_S = 5.0  # the server's per-request deadline
AGENT_TOOL_CALLS = 8
SYSTEM = "Use python."
SLEEP_CALL = "<python>import time; time.sleep(30)</python>"  # what the "sleeper" agent is taught to write


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import ray
    from ray import serve

    from arpo_algo.cli.serve import wait_ready
    from arpo_algo.models import build_tiny_model
    from serve.agents import build_specs
    from serve.app import build_app
    from serve.guard import Security

    root = tmp_path_factory.mktemp("guard")
    model = build_tiny_model(root / "tiny", num_layers=2, hidden_size=64, seed=0)
    sleeper = sleeper_model(root)
    key_file = root / "key"
    key_file.write_text(KEY + "\n")
    port = _free_port()
    saved = {k: os.environ.get(k) for k in ("RAY_memory_monitor_refresh_ms", "RAY_metrics_report_interval_ms")}
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # see test_serve.py
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    metrics_port = _free_port()
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    specs = build_specs([f"tiny={model}"], tools="python", max_tool_calls=AGENT_TOOL_CALLS, max_tokens=16)
    specs += build_specs([f"sleeper={sleeper}"], tools='{"python": {"timeout_s": 30}}', max_tool_calls=1,
                         system_prompt=SYSTEM, max_tokens=64)
    security = Security(key_file=str(key_file), port=port, request_timeout_s=TIMEOUT_S)
    serve.run(build_app(specs, security, max_ongoing_requests=8, max_queued_requests=8), name=APP, route_prefix="/",
              blocking=False)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 300, KEY)
    yield {"url": url, "port": port, "model": model, "metrics_port": metrics_port}
    serve.shutdown()
    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)


def sleeper_model(root):
    """A tiny Llama SFT-ed on one demonstration: asked to sleep, it calls the python tool with a 30 s sleep."""
    import torch

    from arpo_algo.models import build_tiny_model
    from arpo_algo.train.sft import run_sft

    data = root / "sleep.json"
    data.write_text(json.dumps([{"conversations": [{"from": "system", "value": SYSTEM},
                                                   {"from": "human", "value": "Sleep."},
                                                   {"from": "gpt", "value": SLEEP_CALL}]}]))
    base = build_tiny_model(root / "sleeper_base", num_layers=2, hidden_size=64, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_sft({"model": str(base), "data": str(data), "epochs": 100, "batch_size": 1, "lr": 5e-3,
                 "lr_schedule": "constant", "warmup_ratio": 0.0, "output_dir": str(root / "sleeper"),
                 "progress": False, "tensorboard": False})
    finally:
        torch.set_num_threads(threads)
    return root / "sleeper"


def request(srv: dict, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 120) -> tuple[int, dict, Any]:
    """One raw HTTP request (http.client sends exactly the headers given, plus Host unless given)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv["port"], timeout=timeout)
    hdrs = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    hdrs = {k: v for k, v in hdrs.items() if v is not None}
    try:
        conn.putrequest(method, path, skip_host="Host" in hdrs, skip_accept_encoding=True)
        for k, v in hdrs.items():
            conn.putheader(k, v)
        if body is not None and "Content-Length" not in hdrs:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        raw = r.read()
        try:
            out = json.loads(raw)
        except json.JSONDecodeError:
            out = raw.decode(errors="replace")
        return r.status, {k.lower(): v for k, v in r.getheaders()}, out
    finally:
        conn.close()


def chat_body(**extra: Any) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def post_chat(srv: dict, body: dict | bytes, **kw: Any) -> tuple[int, dict, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(srv, "POST", "/v1/chat/completions", data, **kw)


def assert_openai_error(out: Any, code: str | None = None) -> None:
    assert isinstance(out, dict) and set(out) == {"error"}, out
    assert {"message", "type", "code"} <= set(out["error"]) and out["error"]["message"], out
    if code is not None:
        assert out["error"]["code"] == code, out


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
    assert [m.id for m in good.models.list().data] == ["tiny", "sleeper"]
    assert good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2).choices[0].message.content is not None
    assert request(server, "GET", "/health", headers={"Authorization": None})[2] == {"status": "ok"}
    assert request(server, "GET", "/health")[2] == {"status": "ok", "models": ["sleeper", "tiny"]}
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
    """experiments/serve_config.yaml's args through the builder Serve calls: no key -> refused; ARPO_API_KEY set ->
    an application whose deployment arguments do not hold the key."""
    import yaml

    from arpo_base.errors import ConfigError
    from serve.app import build

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "experiments", "serve_config.yaml"), encoding="utf-8") as f:
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


# ------------------------------------------------------------------------------------------------ bounded requests
def test_body_limit_at_and_past_4_mib(server):
    from serve.guard import MAX_BODY_BYTES

    base = json.dumps(chat_body()).encode()
    at_limit = base + b" " * (MAX_BODY_BYTES - len(base))  # JSON allows trailing whitespace
    assert len(at_limit) == MAX_BODY_BYTES and post_chat(server, at_limit)[0] == 200
    status, _, out = post_chat(server, at_limit + b" ")
    assert status == 413
    assert_openai_error(out, "request_too_large")


def test_body_without_length_is_cut_at_the_limit(server):
    """A chunked body announces no length: it is counted as it arrives and refused past the limit."""
    from serve.guard import MAX_BODY_BYTES

    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=120)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        for k, v in (("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json"),
                     ("Transfer-Encoding", "chunked")):
            conn.putheader(k, v)
        conn.endheaders()
        piece = b" " * (1 << 20)
        try:
            for _ in range(MAX_BODY_BYTES // len(piece) + 2):
                conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            conn.send(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed while we were still sending
        r = conn.getresponse()
        out = json.loads(r.read())
    finally:
        conn.close()
    assert r.status == 413
    assert_openai_error(out, "request_too_large")


def test_others_are_answered_while_an_oversized_request_is_refused(server):
    """A client that announces a 1 GiB body and trickles it does not hold up anyone else."""
    sock = socket.create_connection(("127.0.0.1", server["port"]), timeout=60)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{"
                     % (server["port"], KEY.encode(), 1 << 30))
        t0 = time.monotonic()
        status, _, out = post_chat(server, chat_body(), timeout=60)
        assert status == 200 and time.monotonic() - t0 < 30, out
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    finally:
        sock.close()


def test_tokenizing_a_large_body_does_not_stall_the_server(server):
    """A legal 3.9 MB prompt takes seconds to tokenize (then fails the context check): meanwhile /health and a small
    chat request are answered at once, because parsing and tokenizing run off the event loop."""
    big = chat_body(messages=[{"role": "user", "content": "ab " * 1_300_000}])
    result: list = []
    worker = threading.Thread(target=lambda: result.append(post_chat(server, big)))
    worker.start()
    time.sleep(0.5)  # the body is in and being tokenized
    slowest = 0.0
    while worker.is_alive():
        t0 = time.monotonic()
        assert request(server, "GET", "/health", timeout=30)[0] == 200
        assert post_chat(server, chat_body(max_tokens=1), timeout=30)[0] == 200
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.2)
    worker.join()
    status, _, out = result[0]
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert slowest < 2.0, slowest


def test_messages_limit_at_and_past(server):
    from serve.schema import MAX_MESSAGES

    msgs = [{"role": "user", "content": "a"}] * MAX_MESSAGES
    status, _, out = post_chat(server, chat_body(messages=msgs, max_tokens=1))
    assert status == 200, out
    status, _, out = post_chat(server, chat_body(messages=[*msgs, {"role": "user", "content": "a"}]))
    assert status == 400 and out["error"]["param"] == "messages", out


def test_stop_limits_at_and_past(server):
    from serve.schema import MAX_STOP, MAX_STOP_CHARS

    ok = ["x" * MAX_STOP_CHARS] * MAX_STOP
    assert post_chat(server, chat_body(stop=ok))[0] == 200
    for bad in ([*ok, "y"], [*ok[:-1], "x" * (MAX_STOP_CHARS + 1)]):
        status, _, out = post_chat(server, chat_body(stop=bad))
        assert status == 400 and out["error"]["param"] == "stop", out


def test_n_times_tool_calls_limit_at_and_past(server):
    from serve.schema import MAX_REQUEST_TOOL_CALLS

    n = 16
    per_choice = MAX_REQUEST_TOOL_CALLS // n
    status, _, out = post_chat(server, chat_body(n=n, max_tokens=1, arpo={"max_tool_calls": per_choice}))
    assert status == 200 and len(out["choices"]) == n, out
    status, _, out = post_chat(server, chat_body(n=n, max_tokens=1, arpo={"max_tool_calls": per_choice + 1}))
    assert status == 400 and out["error"]["param"] == "n" and "64" in out["error"]["message"], out
    status, _, out = post_chat(server, chat_body(n=n, max_tokens=1))  # the agent's own limit counts too
    assert status == 400 and f"{n} x {AGENT_TOOL_CALLS}" in out["error"]["message"], out


def test_deadline_covers_tool_calls_answers_504_and_frees_the_server(server):
    """The sleeper agent's tool call sleeps 30 s; the request's 5 s deadline answers 504 while it runs."""
    long = {"model": "sleeper", "messages": [{"role": "user", "content": "Sleep."}], "temperature": 0,
            "max_tokens": 64}
    t0 = time.monotonic()
    status, _, out = post_chat(server, long)
    took = time.monotonic() - t0
    assert status == 504 and TIMEOUT_S <= took < TIMEOUT_S + 10, (status, took, out)
    assert_openai_error(out, "timeout")
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**long, "stream": True}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    events = [ln[6:] for ln in r.read().decode().split("\n\n") if ln.startswith("data: ")]
    conn.close()
    assert json.loads(events[-1])["error"]["code"] == "timeout", events[-1]
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content") or "" for d in deltas).endswith(SLEEP_CALL), deltas  # the call was written
    assert not any(d.get("arpo", {}).get("type") == "tool_result" for d in deltas), "the deadline fell in the tool"
    t0 = time.monotonic()
    assert post_chat(server, chat_body())[0] == 200 and time.monotonic() - t0 < 30


def _status_counts(srv: dict) -> dict[str, float]:
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{srv['metrics_port']}/metrics", timeout=10) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = re.search(r'status="(\d+)"', line)
        if "arpo_serve_requests_total{" in line and not line.startswith("#") and m:
            counts[m.group(1)] = counts.get(m.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_refusals_are_counted_once(server):
    before = _status_counts(server)
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
        now = _status_counts(server)
        if all(now.get(k, 0.0) >= v for k, v in want.items()):
            break
        time.sleep(1)
    time.sleep(3)  # a second export of the same counters must not add to them
    now = _status_counts(server)
    assert {k: now.get(k, 0.0) for k in want} == want, (before, now)


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


# ------------------------------------------------------------------------------------ liveness (keep this test last)
def test_stopped_engine_fails_health_answers_503_and_is_replaced(server):
    """Stop the replica's batching front and engine mid-stream: the stream ends with an OpenAI-shaped 503 error,
    new requests get 503 + Retry-After (never a hang or a plain-text 500), /health fails, and Serve replaces the
    replica, after which requests succeed again."""
    import re

    from ray import serve

    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    long = {**chat_body(max_tokens=2000, temperature=0), "stream": True}  # greedy: this model runs long
    conn.request("POST", "/v1/chat/completions", body=json.dumps(long),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    while not re.search(rb'"content": "[^"]', r.readline()):
        pass  # until a token arrived: the request is in the engine
    handle = serve.get_deployment_handle("arpo_agents", app_name=APP)
    handle.options(method_name="stop_engines").remote().result(timeout_s=60)
    rest = r.read().decode()
    conn.close()
    last = [ln[6:] for ln in rest.split("\n\n") if ln.startswith("data: ")][-1]
    assert json.loads(last)["error"]["code"] == "engine_unavailable", rest[-500:]
    status, headers, out = post_chat(server, chat_body(), timeout=30)
    assert status == 503 and headers.get("retry-after"), out
    assert_openai_error(out, "engine_unavailable")
    status, headers, out = request(server, "GET", "/health", headers={"Authorization": None}, timeout=30)
    assert status == 503 and out == {"status": "error"} and headers.get("retry-after")
    seen = set()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        status, headers, out = post_chat(server, chat_body(), timeout=60)
        seen.add(status)
        assert status in (200, 503) and isinstance(out, dict), (status, out)
        if status == 503:
            assert headers.get("retry-after"), (headers, out)
        else:
            break
        time.sleep(1)
    assert status == 200, seen
    assert request(server, "GET", "/health")[0] == 200
