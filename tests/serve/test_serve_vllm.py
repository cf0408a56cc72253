"""``arpo serve --engine vllm`` for real: the command in a subprocess, its Serve app on 127.0.0.1, vLLM in the replica.

One vLLM start for the module: the replica's engine, on the tiny model the other vLLM tests use (2 layers, hidden
256: vLLM's CPU attention needs 64-dim heads). Each request is also run in this process through the same agent code
(``serve.runtime.Agent``) on the HF engine, which is cheap for this model:

* greedy: the served answer equals it token for token (the engine conformance suite shows both engines' greedy
  tokens equal a teacher-forced float32 forward, so this is what the VLLMEngine generates directly);
* sampled with a seed: the served tokens differ from the HF engine's (the engines draw with different RNGs), and the
  same seeded request served again, streamed, gives the same tokens: the answer came from vLLM, with its seeds.

The command's vLLM engine-core process is also looked up among its descendants (other jobs' vLLM processes on a
shared machine do not count), and after SIGTERM the command shuts Serve and Ray down: every process it started,
vLLM's included, must be gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import psutil
import pytest

from arpo_base.http import get_json, post_json
from arpo_base.procs import cmdline, descendants, is_alive, name

pytest.importorskip("ray.serve")
# The module's tests are one server's life, in order: it answers, it loses its engine core, it is shut down. A
# shuffled run (pytest-random-order) keeps this module's order; without the plugin the mark is inert.
pytestmark = [pytest.mark.vllm, pytest.mark.random_order(disabled=True)]

SYSTEM = "Use python."
MESSAGES = [{"role": "user", "content": "What is 17 * 23 + 5?"}]
SESSION = {"tools": "python", "max_tool_calls": 1, "system_prompt": SYSTEM, "max_tokens": 64}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(procs: list) -> list[tuple[int, int, str]]:
    """(pid, parent pid, name) of ``procs``: the failure message when the engine core is not among them."""
    out = []
    for p in procs:
        try:
            out.append((p.pid, p.ppid(), p.name()))
        except psutil.Error:
            continue
    return out


def _engine_cores(procs: list) -> list[int]:
    """Pids of the vLLM engine-core processes among ``procs`` (vLLM titles it ``VLLM::EngineCore``); a process that
    ended meanwhile is none."""
    return [p.pid for p in procs if "EngineCore" in (name(p) or "") or "EngineCore" in (cmdline(p) or "")]


def _log_tail(log, chars: int) -> str:  # noqa: ANN001
    """The last ``chars`` characters the command wrote to ``log`` (its stdout and stderr)."""
    log.seek(0)
    return log.read()[-chars:]


def _with_engine_core(proc, log, timeout_s: float = 120.0) -> list:  # noqa: ANN001
    """The command's descendants once a vLLM engine core is among them, polled for up to ``timeout_s`` (one
    full-suite run found none right after the server was ready; the cause was not found). Fails with the process
    tree and the end of the command's log when none appears or the command exits."""
    deadline = time.monotonic() + timeout_s
    while not _engine_cores(procs := descendants(proc.pid)):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(
                f"no vLLM engine core among the command's processes (exit code {proc.poll()}): "
                f"{_tree(procs)}\n--- arpo serve log (end) ---\n{_log_tail(log, 3000)}"
            )
        time.sleep(1.0)
    return procs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from arpo_algo.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vserve") / "model", num_layers=2, hidden_size=256, seed=0)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """``arpo serve tiny=<model> --engine vllm`` in a subprocess; yields (url, process, its log file)."""
    from serve.cli.serve import wait_ready

    port = _free_port()
    log = open(tmp_path_factory.mktemp("vserve_log") / "serve.log", "w+")  # noqa: SIM115 - closed below
    # see test_serve.py: other jobs' memory is not ours; unbuffered, so the log shows the "serving" line when printed
    env = {**os.environ, "RAY_memory_monitor_refresh_ms": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arpo_algo.cli",
            "serve",
            f"tiny={model_dir}",
            "--engine",
            "vllm",
            "--port",
            str(port),
            "--tools",
            SESSION["tools"],
            "--max-tool-calls",
            str(SESSION["max_tool_calls"]),
            "--system-prompt",
            SYSTEM,
            "--max-tokens",
            str(SESSION["max_tokens"]),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 600)
        # arpo serve is up once it says so: it polls /health itself after the replica answers, and an engine lost
        # before that poll is a start that failed (it exits), not a running server losing its engine
        deadline = time.monotonic() + 120
        while not any(line.startswith("serving ") for line in _log_tail(log, 100_000).splitlines()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"arpo serve did not say it is serving (exit {proc.poll()}):\n{_log_tail(log, 3000)}")
            time.sleep(0.5)
        yield url, proc, log
    finally:
        if proc.poll() is None:
            procs = descendants(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            for p in procs:  # whatever a failed test left behind: only this command's processes
                if is_alive(p):
                    p.kill()
        if proc.returncode not in (0, None):
            print(_log_tail(log, 4000))
        log.close()


@pytest.fixture(scope="module")
def hf_agent(model_dir):
    """The same agent (serve.runtime.Agent: layout, agent loop, batching front) on the HF engine, in this process."""
    from serve.agents import build_specs
    from serve.runtime import Agent

    agent = Agent(build_specs([f"tiny={model_dir}"], engine="hf", **SESSION)[0])
    yield agent
    agent.front.close()


def _post(url: str, body: dict) -> dict:
    return post_json(f"{url}/v1/chat/completions", body, timeout=300)


def _stream(url: str, body: dict) -> tuple[str, list[list[int]]]:
    """Content of choice 0 and every choice's response_ids, from a streamed answer."""
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    text, ids = "", {}
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            for ch in json.loads(line[6:])["choices"]:
                delta = ch["delta"]
                if ch["index"] == 0:
                    text += delta.get("content") or ""
                if delta.get("arpo", {}).get("type") == "done":
                    ids[ch["index"]] = delta["arpo"]["response_ids"]
    return text, [ids[i] for i in sorted(ids)]


def _in_process(agent, body: dict) -> dict:
    from serve.schema import parse_chat_request

    return agent.run(agent.prepare(parse_chat_request(body)), threading.Event())


def _ids(result: dict) -> list[list[int]]:
    return [c["message"]["arpo"]["response_ids"] for c in result["choices"]]


def test_served_answers_come_from_the_vllm_engine(server, hf_agent):
    url, proc, log = server
    procs = _with_engine_core(proc, log)
    assert len(_engine_cores(procs)) == 1, _tree(procs)  # the replica started vLLM (the HF engine has none)
    assert [m["arpo"]["engine"] for m in get_json(f"{url}/v1/models")["data"]] == ["vllm"]

    greedy = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
    served = _post(url, greedy)
    local = _in_process(hf_agent, greedy)
    assert served["usage"] == local["usage"] and served["usage"]["completion_tokens"] == 24
    assert _ids(served) == _ids(local)
    # logprobs: vLLM's raw log-probs are the HF engine's at temperature 1 (and 0: greedy is scored at 1) ...
    with_lp = _post(url, {**greedy, "logprobs": True, "top_logprobs": 2})
    local_lp = _in_process(hf_agent, {**greedy, "logprobs": True, "top_logprobs": 2})
    got, want = with_lp["choices"][0]["logprobs"]["content"], local_lp["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in got] == [e["token"] for e in want] and len(got) == 24
    assert all(abs(a["logprob"] - b["logprob"]) < 0.02 and len(a["top_logprobs"]) == 2 for a, b in zip(got, want))
    # ... and at another temperature they would not be the documented values: refused, saying why
    status, _, body = _answer(url, "/v1/chat/completions", {**greedy, "temperature": 0.7, "logprobs": True})
    assert status == 400 and body["error"]["param"] == "logprobs" and "temperature 1" in body["error"]["message"]

    sampled = {"model": "tiny", "messages": MESSAGES, "temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 24}
    first = _post(url, sampled)
    text, streamed = _stream(url, sampled)
    assert streamed == _ids(first) and text == first["choices"][0]["message"]["content"]
    assert _ids(first)[0] != _ids(first)[1]  # per-choice seeds
    hf_ids = _ids(_in_process(hf_agent, sampled))
    assert all(a != b for a, b in zip(_ids(first), hf_ids)), "sampled like the HF engine: vLLM was not used"


def _answer(url: str, path: str, body: dict | None = None) -> tuple[int, Any, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())  # headers: case-insensitive
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())  # every answer is JSON, errors included


def test_dead_engine_core_fails_health_and_answers_503(server):
    """Kill the replica's vLLM engine-core process: /health fails (so Serve replaces the replica) and a chat request
    gets an OpenAI-shaped 503 with Retry-After, never a hang or a plain-text 500."""
    import psutil

    url, proc, log = server
    for pid in _engine_cores(_with_engine_core(proc, log)):
        psutil.Process(pid).kill()
    deadline, status = time.monotonic() + 60, 200
    while status != 503 and time.monotonic() < deadline:
        status, headers, body = _answer(url, "/health")
        time.sleep(0.2)
    assert status == 503 and body["status"] == "error" and headers.get("Retry-After"), (status, body)
    status, headers, body = _answer(
        url, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    )
    assert status == 503 and headers.get("Retry-After") and body["error"]["code"] == "engine_unavailable", body


def test_sigterm_shuts_down_serve_ray_and_vllm(server):
    url, proc, log = server
    procs = _with_engine_core(proc, log)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    deadline = time.monotonic() + 60
    while (left := [p for p in procs if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    names = [(p.pid, name(p)) for p in left]
    for p in left:  # do not leave them running on a shared machine when the test fails
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    assert code == 0 and names == [], (code, names)
