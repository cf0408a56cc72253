"""``arpo serve`` end to end: real Ray Serve on 127.0.0.1, the official ``openai`` client, a tiny model fine-tuned here.

One Serve application for the whole module, with two agents: ``toolmath`` (a tiny Llama SFT-ed for a few seconds on
ToolMath demonstrations, so it reliably writes a ``<python>`` call on a training question) and ``base`` (the same
architecture, untrained, no tools). The python tool is the real sandboxed one.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import urllib.parse
import urllib.request

import pytest

from arpo_base.http import HTTPJSONError, get_json, request

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

MAX_ONGOING, MAX_QUEUED = 3, 1
N_DEMOS = 4
METRICS_PORT = 0  # Ray's Prometheus export port (set by the server fixture)
SYSTEM = "Use python."  # a short system prompt keeps the demonstrations short (and the SFT fast)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demos():
    from arpo_env.demonstrations import toolmath_demonstrations

    return toolmath_demonstrations(N_DEMOS, seed=0, split="train", levels=[1])


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory, demos):
    """A tiny Llama SFT-ed for ~10 s on a few ToolMath demonstrations: greedy decoding writes their tool call."""
    import torch

    from arpo_algo.models import build_tiny_model
    from arpo_algo.train.sft import run_sft

    root = tmp_path_factory.mktemp("serve")
    data = root / "demos.json"
    data.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "system", "value": SYSTEM},
                        {"from": "human", "value": d["messages"][1]["content"]},
                        {"from": "gpt", "value": "".join(text for text, _ in d["segments"])},
                    ]
                }
                for d in demos
            ]
        )
    )
    base = build_tiny_model(root / "base", num_layers=2, hidden_size=128, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is several times faster than two on a busy machine
    try:
        run_sft(
            {
                "model": str(base),
                "data": str(data),
                "epochs": 150,
                "batch_size": N_DEMOS,
                "lr": 5e-3,
                "lr_schedule": "constant",
                "warmup_ratio": 0.0,
                "output_dir": str(root / "sft"),
                "progress": False,
                "tensorboard": False,
            }
        )
    finally:
        torch.set_num_threads(threads)
    return root / "sft", base


@pytest.fixture(scope="module")
def server(sft_model, demos):
    import ray
    from ray import serve

    from serve.agents import build_specs
    from serve.app import build_app
    from serve.guard import Security

    sft, base = sft_model
    specs = build_specs(
        [f"toolmath={sft}"], tools="python", max_tool_calls=2, system_prompt=SYSTEM, max_tokens=256
    ) + build_specs([f"base={base}"], tools="python", max_tool_calls=0, max_tokens=64)
    port = _free_port()
    # Ray's memory monitor kills workers once the *machine* is 95% full, whoever uses it; on a shared test box
    # that is other people's jobs. The test's own footprint is small (two tiny models).
    saved = {k: os.environ.get(k) for k in ("RAY_memory_monitor_refresh_ms", "RAY_metrics_report_interval_ms")}
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # export metrics every second (default 10 s)
    global METRICS_PORT
    METRICS_PORT = _free_port()
    if ray.is_initialized():  # left by a test that failed elsewhere: one failure must not cascade
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=METRICS_PORT)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    open_local = Security(allow_unauthenticated=True, port=port)  # the guard itself is tested in test_guard.py
    serve.run(
        build_app(specs, open_local, max_ongoing_requests=MAX_ONGOING, max_queued_requests=MAX_QUEUED, retry_after_s=2),
        name="arpo",
        route_prefix="/",
        blocking=False,
    )
    url = f"http://127.0.0.1:{port}"
    from serve.cli.serve import wait_ready

    wait_ready(url, 300)
    yield url
    serve.shutdown()
    ray.shutdown()
    for key, value in saved.items():  # leave the environment as other test modules expect it
        if value is None:
            os.environ.pop(key, None)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def post(url: str, body: bytes | dict, timeout: float = 300) -> tuple[int, dict, dict]:
    """Status, headers and JSON body of a chat request (bytes are sent as they are); an error status is returned,
    not raised, with a body that is not JSON as ``{"raw": text}``."""
    raw, payload = (body, None) if isinstance(body, bytes) else (None, body)
    try:
        reply = request("POST", f"{url}/v1/chat/completions", payload, raw=raw, timeout=timeout)
    except HTTPJSONError as e:
        if e.status is None:
            raise
        return e.status, e.headers, e.data if e.data is not None else {"raw": e.body}
    return reply.status, reply.headers, reply.data


def question(demos, i: int = 0) -> list[dict]:
    return [demos[i]["messages"][1]]


def test_models_and_health(server, client):
    assert sorted(m.id for m in client.models.list().data) == ["base", "toolmath"]
    assert get_json(f"{server}/health") == {"status": "ok", "models": ["base", "toolmath"]}
    one = client.models.retrieve("toolmath")
    assert one.id == "toolmath" and one.object == "model" and one.model_extra["arpo"]["tools"] == ["python"]
    assert one.model_dump() == next(m for m in client.models.list().data if m.id == "toolmath").model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found" and "base, toolmath" in e.value.body["message"]


def test_agent_runs_the_tool_and_answers(client, demos):
    r = client.chat.completions.create(model="toolmath", messages=question(demos), temperature=0, max_tokens=256)
    msg = r.choices[0].message
    ext = msg.model_extra["arpo"]
    assert ext["tool_calls"], msg.content
    call = ext["tool_calls"][0]
    assert call["tool"] == "python" and "print(" in call["args"]["code"]
    # The tool really ran in the sandbox (the code prints an integer) and its result is in the trajectory.
    assert not call["error"] and call["output"].strip().lstrip("-").isdigit(), call
    assert "<python>" in msg.content and f"<result>\n{call['output'].strip()}\n</result>" in ext["trajectory"]
    # The same calls, for a generic client, as Responses items: each function_call followed by its output.
    items = r.choices[0].model_extra["output"]
    assert [i["type"] for i in items] == ["function_call", "function_call_output"] * len(ext["tool_calls"])
    assert items[0]["name"] == "python" and json.loads(items[0]["arguments"]) == call["args"]
    assert items[1]["call_id"] == items[0]["call_id"] and items[1]["output"] == call["output"]
    assert r.usage.completion_tokens == len(ext["response_ids"]) and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason in ("stop", "length") and r.model == "toolmath"


def test_streaming_sends_deltas_and_tool_events(client, demos):
    full = client.chat.completions.create(model="toolmath", messages=question(demos, 1), temperature=0, max_tokens=256)
    stream = client.chat.completions.create(
        model="toolmath",
        messages=question(demos, 1),
        temperature=0,
        max_tokens=256,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, events, finish, usage, items = "", [], None, None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                text += c.delta.content
                events.append("delta")
            ext = (c.delta.model_extra or {}).get("arpo")
            if ext:
                events.append(ext["type"])
            items += c.model_extra.get("output") or []
            finish = c.finish_reason or finish
    assert text == full.choices[0].message.content
    # the tool calls the server ran, as Responses items in the stream: the call, then its output (same call_id)
    assert [i["type"] for i in items[:2]] == ["function_call", "function_call_output"]
    assert items[0]["call_id"] == items[1]["call_id"] and items[0]["name"] == "python"
    assert [(i["name"], i["arguments"]) for i in items if i["type"] == "function_call"] == [
        (i["name"], i["arguments"]) for i in full.choices[0].model_extra["output"] if i["type"] == "function_call"
    ]
    assert "tool_call" in events and "tool_result" in events and events[-1] == "done"
    first_call = events.index("tool_call")
    assert events.index("tool_result") == first_call + 1 and "delta" in events[:first_call]
    assert "delta" in events[first_call:], "the answer after the tool result is streamed too"
    assert finish == full.choices[0].finish_reason and usage.completion_tokens == full.usage.completion_tokens


def test_two_agents_are_routed_by_name(client, demos):
    a = client.chat.completions.create(model="toolmath", messages=question(demos), temperature=0, max_tokens=256)
    b = client.chat.completions.create(model="base", messages=question(demos), temperature=0, max_tokens=32)
    assert a.model == "toolmath" and b.model == "base"
    assert a.choices[0].message.model_extra["arpo"]["tool_calls"]
    assert not b.choices[0].message.model_extra["arpo"]["tool_calls"]
    assert b.usage.completion_tokens <= 32 and b.choices[0].finish_reason == "length"
    assert a.choices[0].message.content != b.choices[0].message.content


def test_bad_inputs_are_400_or_404_and_the_replica_survives(server, client, demos):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=question(demos))
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="toolmath", messages=question(demos), n=99)
    assert e.value.body["param"] == "n"
    cases = [
        (b"{oops", None),
        ({"model": "toolmath"}, "messages"),
        ({"model": "toolmath", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "toolmath", "messages": question(demos), "temperature": 9}, "temperature"),
        ({"model": "toolmath", "messages": question(demos), "top_p": "a"}, "top_p"),
        ({"model": "toolmath", "messages": question(demos), "max_tokens": -1}, "max_tokens"),
        ({"model": "toolmath", "messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
        ({"model": "toolmath", "messages": question(demos), "max_tokens": 100000}, "max_tokens"),
    ]
    for body, param in cases:
        status, _, out = post(server, body)
        assert status == 400, (body, out)
        assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error", out
    # A field that would change the answer and is not done is refused, naming it; an agent's tools are its own.
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}
    for kwargs, param, says in (
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"tools": [weather]}, "tools[0].function.name", "trained on: python"),
        ({"tools": [other]}, "tools[0].function.parameters", '"required": ["code"]'),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="toolmath", messages=question(demos), max_tokens=4, **kwargs)
        assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body
    # What stock clients send at neutral values passes.
    ok = client.chat.completions.create(
        model="base",
        messages=question(demos),
        max_tokens=4,
        user="episode-1",
        parallel_tool_calls=True,
        frequency_penalty=0,
        presence_penalty=0,
        response_format={"type": "text"},
    )
    assert ok.choices[0].message.content is not None


def test_client_side_tools_return_tool_calls_and_accept_results(client, demos):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "python",
                "description": "run Python",
                "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
            },
        }
    ]
    msgs = question(demos, 0)
    r = client.chat.completions.create(model="toolmath", messages=msgs, temperature=0, max_tokens=256, tools=tools)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "python"
    code = json.loads(c.message.tool_calls[0].function.arguments)["code"]
    assert not c.message.model_extra["arpo"]["tool_calls"], "client mode must not run the tool itself"
    answer = "4242"
    follow = [
        *msgs,
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": answer},
    ]
    r2 = client.chat.completions.create(model="toolmath", messages=follow, temperature=0, max_tokens=200, tools=tools)
    assert "print(" in code and r2.usage.prompt_tokens > r.usage.prompt_tokens
    # The continuation saw the tool result: the server appended it exactly as training does.
    ext2 = r2.choices[0].message.model_extra["arpo"]
    assert r2.choices[0].message.content != c.message.content and ext2["response_ids"]


def _reference_logprobs(model_dir, prompt, response, temperature: float):
    """log_softmax(logits / T) at every response position, from one plain transformers forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)


def test_logprobs_are_the_engines_for_every_sampled_token_streaming_too(client, sft_model, demos):
    """``logprobs``/``top_logprobs``: one entry per sampled token (trained mask 1, tool results excluded), each the
    policy's log-prob under the request's temperature (log_softmax(logits / T), checked against a plain forward),
    with the top tokens of its step; the stream's entries add up to the same list."""
    from transformers import AutoTokenizer

    from arpo_algo.rollout.layout import prompt_ids

    args = dict(model="toolmath", messages=question(demos), temperature=0.7, seed=3, max_tokens=160)
    r = client.chat.completions.create(**args, logprobs=True, top_logprobs=3)
    ext = r.choices[0].message.model_extra["arpo"]
    assert ext["tool_calls"], "the run holds a tool result, which has no log-probs"
    sampled = [t for t, m in zip(ext["response_ids"], ext["trained_mask"]) if m == 1]
    content = r.choices[0].logprobs.content
    tok = AutoTokenizer.from_pretrained(str(sft_model[0]))
    assert [e.token for e in content] == [tok.decode([t]) for t in sampled]
    prompt = prompt_ids(tok, [{"role": "system", "content": SYSTEM}, *question(demos)])
    assert r.usage.prompt_tokens == len(prompt)
    ref = _reference_logprobs(sft_model[0], prompt, ext["response_ids"], 0.7)
    positions = [p for p, m in enumerate(ext["trained_mask"]) if m == 1]
    for p, e in zip(positions, content):
        assert abs(e.logprob - ref[p, ext["response_ids"][p]].item()) < 2e-3, (p, e.logprob)
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        best = ref[p].topk(3).values
        assert abs(e.top_logprobs[0].logprob - best[0].item()) < 2e-3
        assert abs(e.top_logprobs[-1].logprob - best[-1].item()) < 2e-3
    streamed = []
    for chunk in client.chat.completions.create(**args, logprobs=True, top_logprobs=3, stream=True):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs and c.logprobs.content else []
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = client.chat.completions.create(**args)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.model_extra["arpo"]["response_ids"] == ext["response_ids"], (
        "logprobs change nothing"
    )


def test_train_serve_parity(server, client, sft_model, demos):
    """Same prompt, seed and checkpoint: the served choices are the GRPO-mode TreeSampler's trajectories."""
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.rollout.engines.base import SamplingParams
    from arpo_algo.rollout.engines.hf.engine import HFEngine
    from arpo_algo.rollout.sampler import TreeSampler
    from arpo_env.core import ToolTextEnv

    seed, n = 1234, 2
    env_cfg = {"task": "toolmath", "levels": [1], "max_tool_calls": 2, "tools": {"python": {}}, "system_prompt": SYSTEM}
    engine = HFEngine(str(sft_model[0]))
    sampler = TreeSampler(
        engine,
        lambda: ToolTextEnv(env_cfg),
        TreeConfig.grpo(n),
        SamplingParams(temperature=1.0),
        max_response_tokens=160,
        seed=seed,
    )
    groups, _ = sampler.sample([0], step=0)
    sampler.close()
    env = ToolTextEnv(env_cfg)
    _, info = env.reset(options={"task_index": 0})
    r = client.chat.completions.create(
        model="toolmath", messages=info["messages"], temperature=1.0, n=n, seed=seed, max_tokens=160
    )
    assert r.usage.prompt_tokens == n * len(groups[0].prompt_ids)
    for traj, choice in zip(groups[0].trajectories, sorted(r.choices, key=lambda c: c.index)):
        ext = choice.message.model_extra["arpo"]
        assert ext["response_ids"] == traj.response_ids
        assert ext["trained_mask"] == traj.trained_mask
        assert [(c["tool"], c["args"]) for c in ext["tool_calls"]] == [(c["tool"], c["args"]) for c in traj.tool_calls]


def test_prometheus_metrics_through_ray(client, demos):
    """Requests, tokens, tool calls and latency reach Ray's Prometheus export, tagged by model."""
    client.chat.completions.create(model="toolmath", messages=question(demos), temperature=0, max_tokens=256)
    wanted = (
        "arpo_serve_requests_total",
        "arpo_serve_tokens_total",
        "arpo_serve_tool_calls_total",
        "arpo_serve_request_latency_s",
    )
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
            text = r.read().decode()
        if all(w in text for w in wanted):
            break
        time.sleep(1)
    lines = [ln for ln in text.splitlines() if "arpo_serve_" in ln and not ln.startswith("#")]
    assert all(w in text for w in wanted), lines
    assert any(
        "arpo_serve_requests_total" in ln and 'model="toolmath"' in ln and 'status="200"' in ln for ln in lines
    ), lines
    assert any("arpo_serve_tool_calls_total" in ln and 'tool="python"' in ln for ln in lines), lines


def test_overload_gives_an_openai_503_with_retry_after_counted_once_and_recovers(server, demos):
    """Three times more requests than the replica runs (MAX_ONGOING) and lets wait (MAX_QUEUED) at once: the rest are
    refused by the replica itself with an OpenAI-shaped 503 (``server_overloaded``) and ``Retry-After``, each counted
    once as 503. Serve's proxy, whose limits sit above the replica's, refuses none: its 503 is plain text."""
    from tests.serve.guarded import counts_reaching, settled_counts

    metrics = {"metrics_port": METRICS_PORT}
    before = settled_counts(metrics)
    body = {"model": "base", "messages": question(demos), "max_tokens": 64, "temperature": 1.0}
    results: list[tuple[int, dict, dict]] = []

    def one() -> None:
        results.append(post(server, body))

    threads = [threading.Thread(target=one) for _ in range(3 * (MAX_ONGOING + MAX_QUEUED))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    codes = sorted(s for s, _, _ in results)
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
    for status, headers, out in results:
        if status == 503:
            assert {k.lower(): v for k, v in headers.items()}.get("retry-after") == "2", headers
            assert set(out) == {"error"} and out["error"]["code"] == "server_overloaded", out
    assert post(server, body)[0] == 200  # not wedged
    want = {"503": before.get("503", 0.0) + codes.count(503), "200": before.get("200", 0.0) + codes.count(200) + 1}
    now = counts_reaching(metrics, want)
    assert {k: now.get(k, 0.0) for k in want} == want, (before, now)


def test_client_disconnect_frees_its_slot(server, demos):
    """Fill every slot with long streams and drop them after the first token: their slots and engine rows are
    freed at once, so new requests are admitted (not refused with 503) and answered long before the dropped
    streams could have finished (2500 tokens each)."""
    import http.client

    port = int(server.rsplit(":", 1)[1])
    long = json.dumps(
        {
            "model": "base",
            "messages": question(demos),
            "max_tokens": 2500,
            "stream": True,
            "temperature": 1.0,
            "seed": 1,
        }
    )
    conns = []
    for _ in range(MAX_ONGOING):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/chat/completions", body=long, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        while not re.search(rb'"content": "[^"]', resp.readline()):
            pass  # until a token arrived: the request holds a slot and an engine row
        conns.append(conn)
    t0 = time.perf_counter()
    for conn in conns:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    short = {"model": "base", "messages": question(demos), "max_tokens": 8}
    results: list[int] = []
    deadline = time.monotonic() + 60
    while len(results) < MAX_ONGOING and time.monotonic() < deadline:
        status = post(server, short)[0]
        if status == 200:
            results.append(status)
        else:  # the proxy may not have seen the disconnects yet
            time.sleep(0.5)
    assert results == [200] * MAX_ONGOING
    elapsed = time.perf_counter() - t0
    one = time.perf_counter()
    post(server, short)
    per_request = time.perf_counter() - one
    assert elapsed < 30 + 10 * per_request, (elapsed, per_request)


def test_chat_page_shows_tool_calls_in_headless_chromium(server, demos, tmp_path):
    """The page at / in a real browser: a question in its URL only fills the form (nothing is sent); pick the agent,
    type, send, and the tool call and its result appear."""
    import base64

    from tests.browser import WebDriver, find_browser

    chromium, chromedriver = find_browser()
    wd = WebDriver(chromedriver, chromium, str(tmp_path / "profile"), size="1100,900")
    try:
        asked = "What is 6 * 7? Use the tool."
        wd.do("POST", "/url", {"url": f"{server}/?agent=base&q={urllib.parse.quote(asked)}"})
        deadline = time.monotonic() + 60
        while wd.js("return document.getElementById('status').textContent") != "ready":
            assert time.monotonic() < deadline, "the page never saw /health ready"
            time.sleep(0.3)
        time.sleep(2)  # the former page sent the question right after /health said ready
        fetched = wd.js("return performance.getEntriesByType('resource').map(e => new URL(e.name).pathname)")
        assert "/v1/models" in fetched and "/v1/chat/completions" not in fetched, fetched
        assert wd.js(
            "return [document.getElementById('agent').value, document.getElementById('input').value, "
            "document.querySelectorAll('#log .msg').length]"
        ) == ["base", asked, 0]
        assert wd.js("return [...document.querySelectorAll('#agent option')].map(o => o.value)") == ["toolmath", "base"]
        q = demos[0]["messages"][1]["content"]
        wd.js(
            f"document.getElementById('agent').value = 'toolmath'; document.getElementById('input').value = "
            f"{json.dumps(q)}; document.getElementById('send').click();"
        )
        deadline = time.monotonic() + 240
        while not wd.js("return document.body.innerText.includes('finish: ')"):
            assert time.monotonic() < deadline, wd.js("return document.body.innerText")
            time.sleep(0.5)
        text = wd.js("return document.getElementById('log').innerText")
        assert q in text and "tool call: python" in text and "result of python" in text, text
        calls = wd.js("return [...document.querySelectorAll('.tool.call')].length")
        results = wd.js("return [...document.querySelectorAll('.tool.result')].length")
        assert calls >= 1 and results == calls
        shot = os.environ.get("ARPO_PAGE_SCREENSHOT")  # look at it: ARPO_PAGE_SCREENSHOT=page.png pytest ...
        if shot:
            with open(shot, "wb") as f:
                f.write(base64.b64decode(wd.do("GET", "/screenshot")))
    finally:
        wd.close()
