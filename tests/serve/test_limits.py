"""Bounded requests, the per-request deadline and liveness against a real server (tests/serve/guarded.py), with the
``sleeper`` agent whose tool call outlasts the deadline.

The last test stops the replica's engines, so it stays last in this module.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from tests.serve.guarded import (
    AGENT_TOOL_CALLS,
    APP,
    EXTRA_TOKEN,
    KEY,
    SLEEP_CALL,
    assert_openai_error,
    chat_body,
    counts_reaching,
    post_chat,
    request,
    server_fixture,
    settled_counts,
)

server = server_fixture(sleeper=True)


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
        for k, v in (
            ("Authorization", f"Bearer {KEY}"),
            ("Content-Type", "application/json"),
            ("Transfer-Encoding", "chunked"),
        ):
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
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{" % (server["port"], KEY.encode(), 1 << 30)
        )
        t0 = time.monotonic()
        status, _, out = post_chat(server, chat_body(), timeout=60)
        assert status == 200 and time.monotonic() - t0 < 30, out
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    finally:
        sock.close()


def test_tokenizing_a_large_body_does_not_stall_the_server(server):
    """A legal 3.9 MB prompt takes seconds to tokenize (then fails the context check): meanwhile /health and a small
    chat request keep being answered, because parsing and tokenizing run off the event loop. Judged relative to the
    tokenization's own duration, not by a wall-clock bound, so a loaded machine does not make it flaky: a blocked
    event loop answers nothing until tokenizing ends, i.e. at most one round would complete, taking about all of it."""
    big = chat_body(messages=[{"role": "user", "content": "ab " * 1_300_000}])
    result: list = []
    worker = threading.Thread(target=lambda: result.append(post_chat(server, big)))
    started = time.monotonic()
    worker.start()
    time.sleep(0.5)  # the body is in and being tokenized
    slowest, rounds = 0.0, 0
    while worker.is_alive():
        t0 = time.monotonic()
        assert request(server, "GET", "/health", timeout=60)[0] == 200
        assert post_chat(server, chat_body(max_tokens=1), timeout=60)[0] == 200
        slowest = max(slowest, time.monotonic() - t0)
        rounds += worker.is_alive()  # a round that finished while the big request was still being handled
        time.sleep(0.2)
    worker.join()
    busy = time.monotonic() - started
    status, _, out = result[0]
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert rounds >= 2 and slowest < busy / 2, (rounds, slowest, busy)


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


def sandbox_processes(root) -> set[tuple[int, str]]:
    """(pid, start time) of every process of the sandboxes under ``root``: those whose command line (bwrap's binds)
    or working folder names it, and all their descendants."""
    import os

    procs: dict[int, tuple[int, str, bool]] = {}  # pid -> (parent, start time, names root)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
            except OSError:
                cwd = ""
        except OSError:  # gone meanwhile
            continue
        if fields[0] in "ZX":
            continue
        procs[int(entry)] = (int(fields[1]), fields[19], str(root) in cmdline or cwd.startswith(str(root)))
    found = {pid for pid, (_, _, mine) in procs.items() if mine}
    while grown := {pid for pid, (ppid, _, _) in procs.items() if ppid in found} - found:
        found |= grown
    return {(pid, procs[pid][1]) for pid in found}


def run_watching_sandboxes(server, call) -> tuple[object, set]:
    """``call()`` in a thread; returns its result and the sandbox processes seen while it ran."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(call()))
    worker.start()
    seen: set = set()
    while worker.is_alive():
        seen |= sandbox_processes(server["sandboxes"])
        time.sleep(0.1)
    worker.join()
    return result[0], seen


def test_deadline_kills_the_running_tool_call_answers_504_and_counts_it_once(server):
    """The sleeper agent's tool call sleeps 30 s, past the request's 5 s deadline: the request gets the deadline's
    504 (in-band for a stream), and by then the sleeping sandbox process is killed and its scratch folder removed,
    not left to run to the tool's own 30 s timeout. Each such request is counted once as 504."""
    long = {"model": "sleeper", "messages": [{"role": "user", "content": "Sleep."}], "temperature": 0, "max_tokens": 64}
    before = settled_counts(server)
    (status, _, out), seen = run_watching_sandboxes(server, lambda: post_chat(server, long))
    assert status == 504, (status, out)
    assert_openai_error(out, "timeout")
    assert seen, "no sandbox process ran during the request: the tool call did not start before the deadline"
    assert not seen & sandbox_processes(server["sandboxes"]), "the sleeping tool call outlived its request"
    assert not list(server["sandboxes"].iterdir())

    def stream() -> list[str]:
        conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps({**long, "stream": True}),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        events = [ln[6:] for ln in conn.getresponse().read().decode().split("\n\n") if ln.startswith("data: ")]
        conn.close()
        return events

    events, seen = run_watching_sandboxes(server, stream)
    assert json.loads(events[-1])["error"]["code"] == "timeout", events[-1]
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content") or "" for d in deltas).endswith(SLEEP_CALL), deltas  # the call was written
    assert not any(d.get("arpo", {}).get("type") == "tool_result" for d in deltas), "the deadline fell in the tool"
    assert seen and not seen & sandbox_processes(server["sandboxes"]), seen
    assert not list(server["sandboxes"].iterdir())
    assert post_chat(server, chat_body())[0] == 200  # the server keeps answering
    want = {"504": before.get("504", 0.0) + 2, "200": before.get("200", 0.0) + 1}
    now = counts_reaching(server, want)
    assert {k: now.get(k, 0.0) for k in want} == want, (before, now)


def test_engine_error_is_an_openai_500_for_that_request_only(server):
    """The broken agent's engine rejects a prompt holding EXTRA_TOKEN deep inside (token id out of range): that
    request gets an OpenAI-shaped 500 naming no file (and the same error in-band for a stream), counted once each;
    the same agent answers other prompts, and other agents answer meanwhile."""
    import openai

    before = settled_counts(server)
    bad = {"model": "broken", "messages": [{"role": "user", "content": f"a {EXTRA_TOKEN} b"}], "max_tokens": 2}
    status, _, out = post_chat(server, bad)
    assert status == 500, (status, out)
    assert_openai_error(out, "internal_error")
    assert out["error"]["type"] == "server_error" and "EngineFailure" in out["error"]["message"], out
    assert str(server["model"].parent) not in out["error"]["message"], out
    client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(**bad)
    assert e.value.status_code == 500 and e.value.body["code"] == "internal_error", e.value.body
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps({**bad, "stream": True}),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    events = [ln[6:] for ln in conn.getresponse().read().decode().split("\n\n") if ln.startswith("data: ")]
    conn.close()
    assert json.loads(events[-1])["error"]["code"] == "internal_error", events
    good = client.chat.completions.create(model="broken", messages=[{"role": "user", "content": "a b"}], max_tokens=2)
    assert good.choices[0].finish_reason in ("stop", "length"), good
    assert post_chat(server, chat_body())[0] == 200
    want = {"500": before.get("500", 0.0) + 3, "200": before.get("200", 0.0) + 2}
    now = counts_reaching(server, want)
    assert {k: now.get(k, 0.0) for k in want} == want, (before, now)


# ------------------------------------------------------------------------------------ liveness (keep this test last)
def test_stopped_engine_fails_health_answers_503_and_is_replaced(server):
    """Stop the replica's batching front and engine mid-stream: the stream ends with an OpenAI-shaped 503 error,
    new requests get 503 + Retry-After (never a hang or a plain-text 500), /health fails, and Serve replaces the
    replica, after which requests succeed again."""
    import re

    from ray import serve

    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    long = {**chat_body(max_tokens=2000, temperature=0), "stream": True}  # greedy: this model runs long
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(long),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
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
