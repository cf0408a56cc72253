"""A real server for the security tests (test_guard.py, test_limits.py) and the HTTP helpers they share."""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openai")  # a module that imports this one is skipped without them
pytest.importorskip("ray.serve")

KEY = "test-key-0123456789abcdef"
APP = "arpo-guard"
TIMEOUT_S = 5.0  # the server's per-request deadline
AGENT_TOOL_CALLS = 8
SYSTEM = "Use python."
SLEEP_CALL = "<python>import time; time.sleep(30)</python>"  # what the "sleeper" agent is taught to write
EXTRA_TOKEN = "<extra_token>"  # in the "broken" agent's tokenizer, beyond its model's embedding rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_fixture(*, sleeper: bool) -> Any:
    """A module-scoped ``server`` fixture of :func:`start_server` (assign it to ``server`` in a test module)."""

    @pytest.fixture(scope="module")
    def server(tmp_path_factory: Any) -> Iterator[dict]:
        yield from start_server(tmp_path_factory, sleeper=sleeper)

    return server


def start_server(tmp_path_factory: Any, *, sleeper: bool, record: Any = None, rewards_key: str = "") -> Iterator[dict]:
    """Ray Serve on 127.0.0.1 with the key, the deadline of TIMEOUT_S and the agent ``tiny`` (untrained, python
    tool, AGENT_TOOL_CALLS calls), plus ``sleeper`` (its sandboxes under the yielded ``sandboxes`` folder) and
    ``broken`` (:func:`broken_model`) when asked, recording episodes with ``record`` (a
    :class:`serve.record.RecordConfig`) and taking rewards with ``rewards_key``; yields the server's facts (``deploy``
    deploys the application again: new replicas), then shuts it down."""
    import ray
    from ray import serve

    from arpo_algo.models import build_tiny_model
    from serve.agents import build_specs
    from serve.app import build_app
    from serve.cli.serve import RAY_LOOPBACK_ENV, local_ray_options, private_token_file, wait_ready
    from serve.guard import Security
    from serve.proxy import controller_options

    root = tmp_path_factory.mktemp("guard")
    model = build_tiny_model(root / "tiny", num_layers=2, hidden_size=64, seed=0)
    key_file = root / "key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    saved = {k: os.environ.get(k) for k in ("RAY_memory_monitor_refresh_ms", "RAY_metrics_report_interval_ms")}
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # see test_serve.py
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    metrics_port = free_port()
    if ray.is_initialized():
        ray.shutdown()
    # Ray as `arpo serve` starts it on loopback: its listeners on loopback, its token file private
    saved[RAY_LOOPBACK_ENV] = os.environ.get(RAY_LOOPBACK_ENV)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        **local_ray_options("127.0.0.1"),
    )
    private_token_file()
    security = Security(key_file=str(key_file), port=port, request_timeout_s=TIMEOUT_S)
    if rewards_key:
        (root / "rewards_key").write_text(rewards_key)
        security.rewards_key_file = str(root / "rewards_key")
    # the proxy's gate as `arpo serve` installs it
    serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=controller_options(security))
    specs = build_specs([f"tiny={model}"], tools="python", max_tool_calls=AGENT_TOOL_CALLS, max_tokens=16)
    sandboxes = root / "sandboxes"
    sandboxes.mkdir()
    if sleeper:
        tools = json.dumps({"python": {"timeout_s": 30, "scratch_root": str(sandboxes)}})
        specs += build_specs(
            [f"sleeper={sleeper_model(root)}"], tools=tools, max_tool_calls=1, system_prompt=SYSTEM, max_tokens=64
        )
        specs += build_specs([f"broken={broken_model(root)}"], tools="python", max_tokens=4)
    url = f"http://127.0.0.1:{port}"

    def deploy() -> None:
        serve.run(
            build_app(specs, security, record=record, max_ongoing_requests=8, max_queued_requests=8),
            name=APP,
            route_prefix="/",
            blocking=False,
        )
        wait_ready(url, 300, KEY)

    deploy()
    yield {
        "url": url,
        "port": port,
        "model": model,
        "metrics_port": metrics_port,
        "sandboxes": sandboxes,
        "deploy": deploy,
    }
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
    data.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "system", "value": SYSTEM},
                        {"from": "human", "value": "Sleep."},
                        {"from": "gpt", "value": SLEEP_CALL},
                    ]
                }
            ]
        )
    )
    base = build_tiny_model(root / "sleeper_base", num_layers=2, hidden_size=64, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_sft(
            {
                "model": str(base),
                "data": str(data),
                "epochs": 100,
                "batch_size": 1,
                "lr": 5e-3,
                "lr_schedule": "constant",
                "warmup_ratio": 0.0,
                "output_dir": str(root / "sleeper"),
                "progress": False,
                "tensorboard": False,
            }
        )
    finally:
        torch.set_num_threads(threads)
    return root / "sleeper"


def broken_model(root):
    """A tiny Llama whose tokenizer was given one more token (EXTRA_TOKEN) without resizing the model: a prompt
    holding it passes every check of the server and is rejected inside the engine (token id out of range)."""
    from transformers import AutoTokenizer

    from arpo_algo.models import build_tiny_model

    folder = build_tiny_model(root / "broken", num_layers=2, hidden_size=64, seed=0)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens([EXTRA_TOKEN])
    tok.save_pretrained(folder)
    return folder


def request(
    srv: dict, method: str, path: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 120
) -> tuple[int, dict, Any]:
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


def status_counts(srv: dict) -> dict[str, float]:
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


def settled_counts(srv: dict) -> dict[str, float]:
    """:func:`status_counts` once earlier requests' counts have reached the export (two reads 2.5 s apart agree)."""
    import time

    before, deadline = status_counts(srv), time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(2.5)
        now = status_counts(srv)
        if now == before:
            break
        before = now
    return before


def counts_reaching(srv: dict, want: dict[str, float]) -> dict[str, float]:
    """:func:`status_counts` once every status of ``want`` reached its count (or after 60 s), read again 3 s later:
    a second export of the same counters must not add to them."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(status_counts(srv).get(k, 0.0) >= v for k, v in want.items()):
            break
        time.sleep(1)
    time.sleep(3)
    return status_counts(srv)
