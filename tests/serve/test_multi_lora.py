"""Many LoRA agents on one base in ``arpo serve``: real Ray Serve on 127.0.0.1, a tiny base with adapters made here.

One application serves ``a`` and ``b`` (two adapters of one base, each with its own system prompt and tool-call
limit), ``plain`` (the base itself, full weights: it runs on the same copy) and ``other`` (another model, an engine
of its own). Then a live update (Serve ``reconfigure``) adds ``c`` and removes ``b`` while streams run.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.request

import pytest

from arpo_base.errors import ConfigError
from arpo_base.http import HTTPJSONError, bearer, get_json, request
from tests.conftest import REPO

pytest.importorskip("ray.serve")

PROMPT = [{"role": "user", "content": "What is 6 times 7?"}]
SESSION = {"tools": "python", "max_tool_calls": 0}
KEY = "test-key-0123456789abcdef"
AUTH = bearer(KEY)
ADMIN = bearer("admin-key-0123456789abcdef")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from arpo_algo.models import build_tiny_adapter, build_tiny_model

    root = tmp_path_factory.mktemp("multi_lora")
    base = build_tiny_model(root / "base", num_layers=2, hidden_size=64, seed=0)
    other = build_tiny_model(root / "other", num_layers=2, hidden_size=64, seed=9)
    return {
        "base": base,
        "other": other,
        "a": build_tiny_adapter(base, root / "a", rank=4, seed=1),
        "b": build_tiny_adapter(base, root / "b", rank=8, seed=2),
        "c": build_tiny_adapter(base, root / "c", rank=4, seed=3),
        "x": build_tiny_adapter(other, root / "x", rank=4, seed=4),
    }


def _specs(folders, names):
    from serve.agents import build_specs

    prompts = {"a": "You are agent A.", "b": "You are agent B.", "c": "You are agent C."}
    specs = []
    for name in names:
        folder = folders[name if name in folders else "base"]
        specs += build_specs(
            [f"{name}={folder}"], max_tokens=16, max_tokens_limit=4096, system_prompt=prompts.get(name), **SESSION
        )
    return specs


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    import ray
    from ray import serve

    from serve.app import build_app
    from serve.guard import Security

    port = _free_port()
    saved = os.environ.get("RAY_memory_monitor_refresh_ms")
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    if ray.is_initialized():
        ray.shutdown()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # replicas import this checkout
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    key_file = tmp_path_factory.mktemp("key") / "api_key"
    key_file.write_text(KEY)
    admin_file = key_file.with_name("admin_key")
    admin_file.write_text(ADMIN["Authorization"].split()[1])
    keyed = Security(key_file=str(key_file), port=port, admin_key_file=str(admin_file))
    first = _specs(folders, FIRST)

    def deploy(specs):  # a list of agents, or a whole user_config (what serve.live.Owner deploys)
        config = specs if isinstance(specs, dict) else {"agents": [s.to_dict() for s in specs]}
        serve.run(
            build_app(first, keyed, user_config=config, max_ongoing_requests=8),
            name="arpo",
            route_prefix="/",
            blocking=False,
        )

    deploy(first)
    url = f"http://127.0.0.1:{port}"
    from serve.cli.serve import wait_ready

    wait_ready(url, 300, KEY)
    yield url, deploy
    serve.shutdown()
    ray.shutdown()
    if saved is None:
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)


def _chat(url, model, **extra):
    body = {"model": model, "messages": PROMPT, "temperature": 0, "max_tokens": 16, **extra}
    return request("POST", f"{url}/v1/chat/completions", body, headers=AUTH, timeout=120).data


def _alone(spec):
    """The agent run in this process on an engine of its own (the one-policy path), same request."""
    import threading as th

    from serve.runtime import Agent
    from serve.schema import parse_chat_request

    agent = Agent(spec)
    try:
        job = agent.prepare(
            parse_chat_request(
                json.dumps({"model": spec.name, "messages": PROMPT, "temperature": 0, "max_tokens": 16}).encode()
            )
        )
        return agent.run(job, th.Event())["choices"][0]["message"]["arpo"]["response_ids"]
    finally:
        agent.front.close()


def test_agents_on_one_base_answer_as_each_served_alone(server, folders):
    url, _ = server
    names = ["a", "b", "plain", "a", "b"]
    out: list = [None] * len(names)

    def ask(i):
        out[i] = _chat(url, names[i])["choices"][0]["message"]["arpo"]["response_ids"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone = {s.name: _alone(s) for s in _specs(folders, ["a", "b", "plain"])}
    assert out == [alone[n] for n in names]
    assert len({tuple(v) for v in alone.values()}) == 3  # three different policies (and prompts)


def test_models_name_each_agents_base_by_fingerprint_not_path(server, folders):
    url, _ = server
    listing = get_json(f"{url}/v1/models", headers=AUTH)
    info = {m["id"]: m["arpo"] for m in listing["data"]}
    assert info["a"]["adapter"] and info["b"]["adapter"] and not info["plain"]["adapter"]
    assert info["a"]["base"] == info["b"]["base"] == info["plain"]["base"] != info["other"]["base"]
    assert len(info["a"]["base"]) == 64 and str(folders["base"]) not in json.dumps(listing)


def _stream(url, model, max_tokens, result):
    body = json.dumps(
        {"model": model, "messages": PROMPT, "temperature": 0, "max_tokens": max_tokens, "stream": True}
    ).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json", **AUTH})
    chunks = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                chunks.append(line[6:])
                result["first"].set()
    result["chunks"], result["ended"] = chunks, time.monotonic()


def _replica_id():
    from ray import serve

    return serve.get_deployment_handle("arpo_agents", "arpo").replica_actor_id.remote().result()


FIRST = ["a", "b", "plain", "other"]  # the agents the module's server starts with


def _serve_first(url, deploy, folders):
    """Give the server its first agents back: a test that changes them leaves the others, run in any order, the
    server they expect."""
    deploy(_specs(folders, FIRST))
    deadline = time.monotonic() + 300
    while {m["id"] for m in get_json(f"{url}/v1/models", headers=AUTH)["data"]} != set(FIRST):
        assert time.monotonic() < deadline, "the first agents did not come back"
        time.sleep(0.2)


def test_live_update_adds_and_removes_agents_without_restarting_the_replica(server, folders):
    url, deploy = server
    try:
        _live_update(url, deploy, folders)
    finally:
        _serve_first(url, deploy, folders)


def _live_update(url, deploy, folders):
    replica = _replica_id()
    streams = {}
    for name in ("a", "b"):  # long streams: they run through the update
        streams[name] = {"first": threading.Event()}
        threading.Thread(target=_stream, args=(url, name, 800, streams[name]), daemon=True).start()
    for s in streams.values():
        assert s["first"].wait(120)
    t0 = time.monotonic()
    deploy(_specs(folders, ["a", "plain", "other", "c"]))  # c added, b removed
    while {m["id"] for m in get_json(f"{url}/v1/models", headers=AUTH)["data"]} != {"a", "plain", "other", "c"}:
        time.sleep(0.2)
    updated = time.monotonic()
    assert _replica_id() == replica
    with pytest.raises(HTTPJSONError) as e:
        _chat(url, "b")
    assert e.value.status == 404
    assert _chat(url, "c")["choices"][0]["message"]["arpo"]["response_ids"] == _alone(_specs(folders, ["c"])[0])
    deadline = time.monotonic() + 240
    while any("ended" not in s for s in streams.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for name, s in streams.items():
        assert s["chunks"][-1] == "[DONE]", (name, s["chunks"][-3:])
        finish = [
            json.loads(c)["choices"][0]["finish_reason"] for c in s["chunks"][:-1] if json.loads(c).get("choices")
        ]
        assert finish[-1] == "length", name  # the whole stream, not cut short by the update
        assert s["ended"] > t0, name
        assert s["ended"] > updated, name  # still running when the update was done


def test_arpo_serve_admins_change_the_agents_with_the_admin_key(server, folders):
    """``POST /v1/agents``: the replica hands the change to the deployment's owner (here this process, as
    ``arpo serve`` does), which checks, resolves and redeploys; a bad change is a 400 that changes nothing. The chat
    key is not the admin key."""
    from serve.admin import AdminPolicy
    from serve.agents import build_specs
    from serve.live import Owner

    url, deploy = server
    served = {m["id"] for m in get_json(f"{url}/v1/models", headers=AUTH)["data"]}
    specs = [s for s in _specs(folders, sorted(served)) if s.name in served]
    owner = Owner(
        specs,
        lambda sources: build_specs(sources, max_tokens=16, **SESSION),
        deploy,
        AdminPolicy(roots=[str(folders["base"].parent)]),
        lambda: 1,
    )
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            owner.poll()
            time.sleep(0.2)

    threading.Thread(target=loop, daemon=True).start()
    try:
        with pytest.raises(HTTPJSONError) as e:  # no key
            request("POST", f"{url}/v1/agents", {"add": [f"d={folders['c']}"]}, timeout=60)
        assert e.value.status == 401
        with pytest.raises(HTTPJSONError) as e:  # the chat key
            request("POST", f"{url}/v1/agents", {"add": [f"d={folders['c']}"]}, headers=AUTH, timeout=60)
        assert e.value.status == 401 and e.value.data["error"]["code"] == "invalid_admin_key"
        with pytest.raises(HTTPJSONError) as e:  # an adapter of another base: refused, nothing changes
            request("POST", f"{url}/v1/agents", {"add": [f"x={folders['x']}"]}, headers=ADMIN, timeout=300)
        assert e.value.status == 400 and "fingerprint" in e.value.data["error"]["message"]
        with pytest.raises(HTTPJSONError) as e:
            request("POST", f"{url}/v1/agents", {"add": [f"a={folders['c']}"]}, headers=ADMIN, timeout=300)
        assert e.value.status == 400 and "two agents are named 'a'" in e.value.data["error"]["message"]
        assert {m["id"] for m in get_json(f"{url}/v1/models", headers=AUTH)["data"]} == served
        out = request(
            "POST", f"{url}/v1/agents", {"add": [f"d={folders['c']}"], "remove": ["other"]}, headers=ADMIN, timeout=300
        ).data
        assert sorted(out["models"]) == sorted(served - {"other"} | {"d"})
        assert _chat(url, "d")["choices"][0]["message"]["arpo"]["response_ids"]
    finally:
        stop.set()
        _serve_first(url, deploy, folders)


def test_adapters_of_two_bases_are_refused_naming_both_fingerprints(folders):
    from arpo_algo.models.lora import weights_fingerprint
    from serve.agents import build_specs

    with pytest.raises(ConfigError) as e:
        build_specs([f"a={folders['a']}", f"x={folders['x']}"], max_tokens=16, **SESSION)
    msg = e.value.message
    assert weights_fingerprint(folders["base"])[:12] in msg and weights_fingerprint(folders["other"])[:12] in msg


def test_a_duplicate_agent_name_is_refused(folders):
    from serve.agents import build_specs, check_agents
    from serve.app import build_app
    from serve.guard import Security

    with pytest.raises(ConfigError, match="two agents are named 'a'"):
        build_specs([f"a={folders['a']}", f"a={folders['b']}"], max_tokens=16, **SESSION)
    twice = _specs(folders, ["a"]) + _specs(folders, ["a"])
    with pytest.raises(ConfigError, match="two agents are named 'a'"):
        check_agents(twice)
    with pytest.raises(ConfigError, match="two agents are named 'a'"):
        build_app(twice, Security(allow_unauthenticated=True))


def test_a_deployments_user_config_names_its_agents(folders):
    from serve.agent_set import agents_from_config

    specs = _specs(folders, ["a", "plain"])
    assert agents_from_config({"agents": [s.to_dict() for s in specs]}) == specs
    listed = agents_from_config(
        {"models": f"a={folders['a']},plain={folders['base']}", "tools": "python", "max_tool_calls": "0"}
    )
    assert [(s.name, bool(s.base)) for s in listed] == [("a", True), ("plain", False)]
    with pytest.raises(ConfigError, match="unknown keys"):
        agents_from_config({"agents": [], "models": "x"})
    with pytest.raises(ConfigError, match="not an agent spec"):
        agents_from_config({"agents": [{"name": "a", "path": "/tmp"}]})
