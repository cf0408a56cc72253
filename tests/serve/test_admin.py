"""Live agent changes as their own permission, applied all or nothing (``serve.admin``, ``serve.live``).

The checks of a change's sources and keys run here without Ray. Then one real Ray Serve application with two
replicas (tiny models, 127.0.0.1) serves ``a`` (an adapter) and ``plain`` (its base), its owner polled from this
process as ``arpo serve`` does: changes that resolve but do not load, that a replica refuses, that swap the base, that
one replica alone refuses, that are too big for the budget, too slow or concurrent, each leave both replicas serving
what they served; a good one is applied everywhere, and its cost (request to the new agent's first answer) printed.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import pytest

from arpo_base.errors import ConfigError
from arpo_base.http import HTTPJSONError, bearer, get_json, request
from tests.conftest import REPO

KEY, ADMIN_KEY = "chat-key-0123456789abcdef", "admin-key-0123456789abcdef"
AUTH, ADMIN = bearer(KEY), bearer(ADMIN_KEY)
SESSION = {"tools": "python", "max_tool_calls": 0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import AutoTokenizer

    from arpo_algo.models import build_tiny_adapter, build_tiny_model

    root = tmp_path_factory.mktemp("admin_root")
    base = build_tiny_model(root / "base", num_layers=2, hidden_size=64, seed=0)
    other = build_tiny_model(root / "other", num_layers=2, hidden_size=64, seed=9)
    out = {
        "root": root,
        "base": base,
        "a": build_tiny_adapter(base, root / "a", rank=4, seed=1),
        "c": build_tiny_adapter(base, root / "c", rank=4, seed=3),
        "x": build_tiny_adapter(other, root / "x", rank=4, seed=4),
    }
    (root / "lone").mkdir()  # resolves as a model folder, but holds no weights
    shutil.copy(base / "config.json", root / "lone" / "config.json")
    shutil.copytree(out["c"], root / "badtok")  # an adapter whose tokenizer is not its base's: the replica refuses it
    tok = AutoTokenizer.from_pretrained(out["c"])
    tok.add_tokens(["<not-in-the-base>"])
    tok.save_pretrained(root / "badtok")
    out["lone"], out["badtok"] = root / "lone", root / "badtok"
    outside = tmp_path_factory.mktemp("outside")
    out["outside"] = shutil.copytree(out["c"], outside / "c")  # loadable, but not under the root
    return out


# --------------------------------------------------------------------------------------------- without Ray
def test_sources_outside_the_roots_read_the_same_whether_or_not_they_exist(folders, tmp_path):
    from serve.admin import AdminPolicy

    policy = AdminPolicy(roots=[str(folders["root"])])
    (folders["root"] / "link").symlink_to(folders["outside"], target_is_directory=True)
    said = []
    for source in (folders["outside"], folders["outside"].parent / "missing", folders["root"] / "link", "~/x", ".."):
        with pytest.raises(ConfigError) as e:
            policy.source(f"z={source}")
        said.append(e.value.message)
    assert len(set(said)) == 1 and "not a model folder under the admin roots" in said[0]
    assert str(folders["outside"]) not in said[0]
    assert policy.source(f"c={folders['c']}") == f"c={os.path.realpath(folders['c'])}"
    assert policy.source("c").endswith(f"{os.sep}c")  # relative: under the first root


def test_a_fifo_or_an_oversized_json_in_a_source_is_refused_without_reading_it(folders, tmp_path):
    from serve.admin import MAX_JSON_BYTES, AdminPolicy

    root = tmp_path / "root"
    fifo = shutil.copytree(folders["base"], root / "fifo")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")  # opened blocking, this would wait for a writer forever
    big = shutil.copytree(folders["base"], root / "big")
    (big / "extra.json").write_text(" " * (MAX_JSON_BYTES + 1))
    policy = AdminPolicy(roots=[str(root)])
    said: dict = {}

    def run():
        for name in ("fifo", "big"):
            try:
                policy.source(f"{name}={root / name}")
            except ConfigError as e:
                said[name] = e.message

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "a FIFO blocked the check"
    assert "config.json is not a regular file" in said["fifo"]
    assert "extra.json is larger than" in said["big"]


def test_an_adapters_base_outside_the_roots_is_refused(folders, tmp_path):
    from serve.admin import AdminPolicy

    root = tmp_path / "only_adapters"
    shutil.copytree(folders["c"], root / "c")  # its base lies outside this root
    with pytest.raises(ConfigError, match="its base model is not a folder under the admin roots"):
        AdminPolicy(roots=[str(root)]).source(f"c={root / 'c'}")


def test_the_memory_budget_counts_a_shared_base_once(folders):
    from serve.admin import AdminPolicy, served_weights, weights_bytes
    from serve.agents import build_specs

    specs = build_specs([f"a={folders['a']}", f"c={folders['c']}", f"plain={folders['base']}"], **SESSION)
    total = served_weights(specs)
    assert total == weights_bytes(folders["base"]) + weights_bytes(folders["a"]) + weights_bytes(folders["c"])
    AdminPolicy(roots=[str(folders["root"])], memory_budget_bytes=total).check_budget(specs)
    with pytest.raises(ConfigError, match="over the server's memory budget"):
        AdminPolicy(roots=[str(folders["root"])], memory_budget_bytes=total - 1).check_budget(specs)


def test_the_admin_key_is_its_own_and_never_the_chat_key(tmp_path):
    import argparse

    from arpo_base.errors import ArpoError
    from serve.cli.serve import admin_of, register
    from serve.guard import Policy, Refusal, Security

    chat, admin = tmp_path / "chat", tmp_path / "admin"
    chat.write_text(KEY)
    admin.write_text(KEY)
    with pytest.raises(ConfigError, match="the admin key is the API key"):
        Security(key_file=str(chat), admin_key_file=str(admin)).admin_key()
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    same = parser.parse_args(["serve", "m", "--admin-key", KEY, "--admin-root", str(tmp_path)])
    with pytest.raises(ArpoError, match="the admin key is the API key"):
        admin_of(same, KEY)
    with pytest.raises(ArpoError, match="--admin-root needs an admin key"):
        admin_of(parser.parse_args(["serve", "m", "--admin-root", str(tmp_path)]), KEY)
    with pytest.raises(ConfigError, match="at least one --admin-root"):
        admin_of(parser.parse_args(["serve", "m", "--admin-key", ADMIN_KEY]), KEY)
    assert admin_of(parser.parse_args(["serve", "m"]), KEY) == (None, None)  # off unless enabled
    host = {"host": "127.0.0.1:8000"}
    chat_h, admin_h = ({k.lower(): v for k, v in h.items()} for h in (AUTH, ADMIN))  # as the guard reads them
    admin.write_text(ADMIN_KEY)
    off = Policy(Security(key_file=str(chat)))
    with pytest.raises(Refusal) as r:
        off.check("POST", "/v1/agents", {**host, **chat_h})
    assert r.value.status == 403 and r.value.code == "admin_disabled"
    on = Policy(Security(key_file=str(chat), admin_key_file=str(admin)))
    for headers, status in ((chat_h, 401), ({}, 401), (admin_h, None)):
        for method in ("POST", "GET"):
            try:
                on.check(method, "/v1/agents", {**host, **headers, "content-type": "application/json"})
                got = None
            except Refusal as e:
                got = e.status
            assert got == status, (headers, method)
    with pytest.raises(Refusal) as r:  # the admin key does not chat
        on.check("GET", "/v1/models", {**host, **admin_h})
    assert r.value.status == 401


# ------------------------------------------------------------------------------------------------ with Ray
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    pytest.importorskip("ray.serve")
    import ray
    from ray import serve

    from serve.admin import AdminPolicy
    from serve.agents import build_specs
    from serve.app import build_app
    from serve.cli.serve import wait_ready
    from serve.guard import Security
    from serve.live import Owner, running_replicas

    port = _free_port()
    if ray.is_initialized():
        ray.shutdown()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # replicas import this checkout
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "RAY_memory_monitor_refresh_ms": "0"}},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    keys = tmp_path_factory.mktemp("keys")
    (keys / "chat").write_text(KEY)
    (keys / "admin").write_text(ADMIN_KEY)
    security = Security(key_file=str(keys / "chat"), admin_key_file=str(keys / "admin"), port=port)

    def resolve(sources):
        return build_specs(sources, max_tokens=8, **SESSION)

    first = resolve([f"a={folders['a']}", f"plain={folders['base']}"])

    def deploy(config):
        app = build_app(first, security, user_config=config, replicas=2, max_ongoing_requests=4)
        serve.run(app, name="arpo", route_prefix="/", blocking=False)

    # as arpo serve does: the owner (its mailbox) first, then the deployment, polled from here
    owner = Owner(first, resolve, deploy, AdminPolicy(roots=[str(folders["root"])]), running_replicas)
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            owner.poll()
            time.sleep(0.2)

    threading.Thread(target=poll, daemon=True).start()
    deploy(Owner.config(first))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 300, KEY)
    yield url, owner
    stop.set()
    serve.shutdown()
    ray.shutdown()


def _change(url, body, timeout=300):
    return request("POST", f"{url}/v1/agents", body, headers=ADMIN, timeout=timeout).data


def _refused(url, body):
    with pytest.raises(HTTPJSONError) as e:
        _change(url, body)
    return e.value.status, e.value.data["error"]["message"]


def _served_everywhere(url):
    """The agents each replica lists (8 requests: both replicas answer some, with near certainty)."""
    return {tuple(sorted(m["id"] for m in get_json(f"{url}/v1/models", headers=AUTH)["data"])) for _ in range(8)}


def _answers(url, model):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    return request("POST", f"{url}/v1/chat/completions", body, headers=AUTH, timeout=120).data["choices"]


def test_a_change_right_after_ready_that_does_not_load_changes_nothing(server, folders):
    """The first request after /health said ready: a folder that resolves but holds no weights, an adapter whose
    tokenizer the replica refuses, a base swap. Each is a 400 naming the agent; both replicas serve on."""
    url, _ = server
    status, said = _refused(url, {"add": [f"lone={folders['lone']}"]})
    assert status == 400 and "'lone'" in said, said
    status, said = _refused(url, {"add": [f"badtok={folders['badtok']}"]})
    assert status == 400 and "'badtok'" in said and "tokenizer" in said, said
    status, said = _refused(url, {"add": [f"x={folders['x']}"], "remove": ["a"]})  # the adapters' base swapped
    assert status == 400 and "'x'" in said and "base" in said, said
    assert _served_everywhere(url) == {("a", "plain")}
    for _ in range(4):
        assert _answers(url, "a") and _answers(url, "plain")
    state = get_json(f"{url}/v1/agents", headers=ADMIN)
    assert state["models"] == ["a", "plain"] and state["change"]["state"] == "refused"


def test_a_change_one_replica_refuses_leaves_both_on_the_served_set(server, folders):
    from ray import serve

    url, _ = server
    handle = serve.get_deployment_handle("arpo_agents", "arpo")
    handle.refuse_next_change.remote("this replica refuses (test)").result()  # one replica, chosen by Serve
    status, said = _refused(url, {"add": [f"c={folders['c']}"]})
    assert status == 400 and "this replica refuses (test)" in said
    assert _served_everywhere(url) == {("a", "plain")}
    t0 = time.perf_counter()
    assert _change(url, {"add": [f"c={folders['c']}"]})["models"] == ["a", "plain", "c"]
    assert _answers(url, "c")
    cost = time.perf_counter() - t0
    print(f"live change cost (tiny model, 2 replicas, request to the new agent's first answer): {cost:.2f} s")
    assert _served_everywhere(url) == {("a", "c", "plain")}
    assert get_json(f"{url}/v1/agents", headers=ADMIN)["change"]["state"] == "applied"


def test_refusals_before_anything_loads(server, folders):
    """Outside the roots, over the caps, over the memory budget: refused by the owner, nothing staged."""
    url, owner = server
    served = _served_everywhere(url)
    outside = [_refused(url, {"add": [f"z={p}"]}) for p in (folders["outside"], folders["outside"].parent / "none")]
    assert outside[0] == outside[1] and outside[0][0] == 400
    status, said = _refused(url, {"add": [f"n{i}={folders['c']}" for i in range(9)]})
    assert status == 400 and "at most 8 agents" in said
    owner.admin.memory_budget_bytes = 1
    try:
        status, said = _refused(url, {"add": [f"d={folders['c']}"]})
    finally:
        owner.admin.memory_budget_bytes = None
    assert status == 400 and "memory budget" in said
    with pytest.raises(HTTPJSONError) as e:  # the chat key neither changes nor lists
        request("POST", f"{url}/v1/agents", {"remove": ["c"]}, headers=AUTH, timeout=60)
    assert e.value.status == 401
    with pytest.raises(HTTPJSONError) as e:
        get_json(f"{url}/v1/agents", headers=AUTH)
    assert e.value.status == 401
    assert _served_everywhere(url) == served


def test_one_change_at_a_time_and_a_late_one_is_not_applied(server, folders):
    """A second change while one runs: 429. A change past its deadline: 504, and GET /v1/agents says it was not
    applied. Chat answers meanwhile."""
    url, owner = server
    served = _served_everywhere(url)
    t0 = time.perf_counter()
    owner.checked({"add": [f"e={folders['c']}"]})  # what the change's checks take (they change nothing)
    owner.admin.timeout_s = time.perf_counter() - t0 + 0.3  # enough for the checks, too short to stage in two replicas
    first: dict = {}

    def slow():
        try:
            _change(url, {"add": [f"e={folders['c']}"]})
        except HTTPJSONError as e:
            first["status"], first["code"] = e.status, e.data["error"]["code"]

    worker = threading.Thread(target=slow)
    try:
        worker.start()
        time.sleep(1.0)
        status, said = _refused(url, {"remove": ["c"]})
        assert status == 429 and "in progress" in said
        t0 = time.perf_counter()
        assert _answers(url, "a")  # chat does not wait for the change
        assert time.perf_counter() - t0 < 30
        worker.join(300)
    finally:
        owner.admin.timeout_s = 600.0
    assert first == {"status": 504, "code": "timeout"}
    deadline = time.monotonic() + 120
    while (state := get_json(f"{url}/v1/agents", headers=ADMIN)["change"])["state"] == "in progress":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert state["state"] == "not applied"
    print("the late change:", state["error"])  # "not loaded": dropped after staging; "not checked": before
    assert _served_everywhere(url) == served
    assert _change(url, {"remove": ["c"]})["models"] == ["a", "plain"]  # the next change runs
