"""``arpo serve --record`` over HTTP: a real Ray Serve application (the tiny model, 127.0.0.1) recording episodes
named by the ``arpo-episode`` header or the ``arpo`` extension, rewards posted with their own key, and a new
deployment (new replica processes) continuing an episode. The keys and settings are also checked without Ray."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from arpo_base.errors import ArpoError, ConfigError
from serve.record import RecordConfig, read_lines, scope_of
from tests.serve.guarded import KEY, assert_openai_error, chat_body, post_chat, request, start_server

REWARDS_KEY = "rewards-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"


def _parse(*argv):
    from serve.cli.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", "m", *argv])


# --------------------------------------------------------------------------------------------- without Ray
def test_recording_is_off_by_default_and_the_rewards_key_is_its_own(tmp_path, monkeypatch):
    from serve.cli.serve import record_of
    from serve.guard import Policy, Refusal, Security
    from serve.record import request_episode
    from serve.schema import parse_chat_request

    monkeypatch.delenv("ARPO_REWARDS_KEY", raising=False)
    assert record_of(_parse(), KEY, None) == (None, None)
    req = parse_chat_request(json.dumps({**chat_body(), "arpo": {"episode": "e"}}))
    with pytest.raises(Exception, match="records no episodes"):
        request_episode(req, {}, None)
    with pytest.raises(ArpoError, match="needs a record folder"):
        record_of(_parse("--rewards-key", REWARDS_KEY), KEY, None)
    for same, name in ((KEY, "API key"), (ADMIN_KEY, "admin key")):
        with pytest.raises(ArpoError, match=f"the rewards key is the {name}"):
            record_of(_parse("--record", str(tmp_path / "r"), "--rewards-key", same), KEY, ADMIN_KEY)
    config, key = record_of(_parse("--record", str(tmp_path / "r"), "--rewards-key", REWARDS_KEY), KEY, ADMIN_KEY)
    assert key == REWARDS_KEY and config.dir == str(tmp_path / "r") and (tmp_path / "r").stat().st_mode & 0o777 == 0o700
    with pytest.raises(ConfigError, match="size cap"):
        record_of(_parse("--record", str(tmp_path / "r"), "--record-max-gib", "0"), KEY, None)
    chat, rewards = tmp_path / "chat", tmp_path / "rewards"
    chat.write_text(KEY)
    rewards.write_text(KEY)
    with pytest.raises(ConfigError, match="the rewards key is the API key"):
        Security(key_file=str(chat), rewards_key_file=str(rewards)).rewards_key()
    # without a rewards key the route is refused to everyone, the chat key included: 403, never open
    policy = Policy(Security(key_file=str(chat)))
    with pytest.raises(Refusal) as e:
        policy.check("POST", "/v1/rewards", {"host": "127.0.0.1:8000", "authorization": f"Bearer {KEY}"})
    assert (e.value.status, e.value.code) == (403, "rewards_disabled")


def test_a_rewards_key_without_a_record_folder_refuses_to_build(tmp_path):
    from serve.app import build_app
    from serve.guard import Security

    (tmp_path / "chat").write_text(KEY)
    (tmp_path / "rewards").write_text(REWARDS_KEY)
    sec = Security(key_file=str(tmp_path / "chat"), rewards_key_file=str(tmp_path / "rewards"))
    with pytest.raises(ConfigError, match="needs a record folder"):
        build_app([], sec)


# --------------------------------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rec") / "episodes"
    config = RecordConfig(str(folder))
    for srv in start_server(tmp_path_factory, sleeper=False, record=config, rewards_key=REWARDS_KEY):
        srv["folder"] = folder
        yield srv


def reward(srv, body, key=REWARDS_KEY):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(srv, "POST", "/v1/rewards", data, headers={"Authorization": f"Bearer {key}"})


def test_episodes_by_header_or_extension_rewards_with_their_own_key(server):
    status, _, out = post_chat(server, chat_body(max_tokens=4, n=2), headers={"arpo-episode": "h1"})
    assert status == 200, out
    record = out["choices"][0]["message"]["arpo"]["record"]
    assert record["episode"] == f"{scope_of(KEY)}/h1" and record["recorded"]
    [turn] = read_lines(server["folder"] / scope_of(KEY) / "h1.jsonl")
    for rec, choice in zip(turn["choices"], out["choices"]):
        assert rec["response_ids"] == choice["message"]["arpo"]["response_ids"]
        assert len(rec["logprobs"]) == sum(rec["trained_mask"])  # asked for by the recorder, not the client
        assert all(math.isfinite(v) and v <= 0 for v in rec["logprobs"])
    assert turn["policy"]["fingerprint"]  # the served weights
    status, _, out = post_chat(server, chat_body(arpo={"episode": "b1"}), headers={"arpo-episode": "other"})
    assert status == 400 and "different episodes" in out["error"]["message"]
    assert post_chat(server, chat_body(), headers={"arpo-episode": "../x"})[0] == 400
    status, _, out = post_chat(server, chat_body(max_tokens=2))  # no episode: nothing recorded
    assert status == 200 and "record" not in out["choices"][0]["message"]["arpo"]
    assert sorted(p.name for p in (server["folder"] / scope_of(KEY)).iterdir()) == ["h1.jsonl"]

    ep = record["episode"]
    status, _, out = reward(server, {"episode": ep, "reward": 1.0}, key=KEY)  # the chat key cannot reward
    assert status == 401 and out["error"]["code"] == "invalid_rewards_key"
    assert reward(server, {"episode": ep, "reward": 1.0}, key="")[0] == 401
    status, _, out = post_chat(server, chat_body(), headers={"Authorization": f"Bearer {REWARDS_KEY}"})
    assert status == 401 and out["error"]["code"] == "invalid_api_key"  # the rewards key cannot chat
    status, _, out = reward(server, b'{"episode": "%s", "reward": Infinity}' % ep.encode())
    assert status == 400 and out["error"]["param"] == "reward"
    status, _, out = reward(server, {"episode": f"{scope_of(KEY)}/nobody", "reward": 1.0})
    assert status == 404
    assert_openai_error(out, "not_found")
    status, _, out = reward(server, {"episode": ep, "reward": 0.5, "turn_rewards": [0.5]})
    assert status == 200 and out == {"episode": ep, "reward": 0.5, "turns": 1}
    status, _, out = reward(server, {"episode": ep, "reward": 1.0})
    assert status == 409 and out["error"]["code"] == "conflict"
    assert json.loads((server["folder"] / scope_of(KEY) / "h1.reward.json").read_text())["reward"] == 0.5


def test_new_replicas_continue_an_episode_token_for_token(server):
    from ray import serve

    from tests.serve.guarded import APP

    messages = [{"role": "user", "content": "hi"}]
    status, _, out = post_chat(server, chat_body(messages=messages, max_tokens=6, arpo={"episode": "r1"}))
    assert status == 200, out
    serve.delete(APP)  # the replica process ends; a new one starts on the same folder
    server["deploy"]()
    messages += [
        {"role": "assistant", "content": out["choices"][0]["message"]["content"]},
        {"role": "user", "content": "go on"},
    ]
    status, _, out = post_chat(server, chat_body(messages=messages, max_tokens=6, arpo={"episode": "r1"}))
    assert status == 200, out
    first, second = read_lines(server["folder"] / scope_of(KEY) / "r1.jsonl")
    assert (second["turn"], second["segment"], second["continues"]) == (1, 0, True)
    head = first["prompt_ids"] + first["choices"][0]["response_ids"]
    assert second["prompt_ids"][: len(head)] == head
    assert record_outcomes(server).get("continued", 0) >= 1  # counted where an operator looks


def record_outcomes(srv, timeout_s=60.0):
    """``arpo_serve_record_turns_total`` by outcome, once its export shows a continued turn (or after timeout_s)."""
    import re
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv['metrics_port']}/metrics", timeout=10) as r:
            text = r.read().decode()
        counts: dict = {}
        for line in text.splitlines():
            m = re.search(r'outcome="(\w+)"', line)
            if "arpo_serve_record_turns_total{" in line and not line.startswith("#") and m:  # Ray adds a prefix
                counts[m.group(1)] = counts.get(m.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
        if "continued" in counts or time.monotonic() > deadline:
            return counts
        time.sleep(1.0)
