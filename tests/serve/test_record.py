"""Episode recording and rewards (serve.record) on an in-process agent: a scripted engine behind the real batching
front, the real tool session and the real recorder (the HTTP routes and keys are tests/serve/test_record_server.py's).

Token faithfulness is checked against what the engine itself was given and sampled, not against the recorder's own
rendering."""

from __future__ import annotations

import json
import math
import os
import stat
import threading
import time

import pytest

from arpo_base.errors import ConfigError
from serve.agents import AgentSpec
from serve.batching import BatchingEngine
from serve.errors import APIError
from serve.record import RecordConfig, Recorder, read_episodes, read_lines, scope_of
from serve.runtime import Agent
from serve.schema import parse_chat_request
from tests.arpo_algo.rollout.test_sampler import ScriptedEngine

SESSION = {"max_tool_calls": 2, "tools": {"python": {}}}
SCOPE = scope_of("client-key")


class Engine(ScriptedEngine):
    """The scripted engine, keeping each request it was given with what it sampled."""

    def __init__(self, calls=(1, 1)):
        super().__init__(calls=calls)
        self.log = []

    def generate(self, requests, *, on_token=None):
        gens = super().generate(requests, on_token=on_token)
        self.log += [(list(r.token_ids), list(g.token_ids), list(g.logprobs)) for r, g in zip(requests, gens)]
        return gens


@pytest.fixture()
def agent(request):
    engine = Engine(getattr(request, "param", (1, 1)))
    a = Agent(AgentSpec(name="m", model_path="", session=SESSION), front=BatchingEngine(engine))
    a.engine = engine
    yield a
    a.front.close()


@pytest.fixture()
def recorder(tmp_path):
    return Recorder(RecordConfig(str(tmp_path / "rec")))


def ask(agent, recorder, messages, episode="ep1", stream=False, scope=SCOPE, **extra):
    body = {"model": "m", "messages": messages, "max_tokens": 300, **extra}
    if episode is not None and "arpo" not in extra:
        body["arpo"] = {"episode": episode}
    job = agent.prepare(parse_chat_request(json.dumps(body)), recorder, scope)
    events = []
    emit = (lambda kind, i, payload: events.append((kind, i, payload))) if stream else None
    out = agent.run(job, threading.Event(), emit)
    return out, events


def turns(recorder, episode="ep1", scope=SCOPE):
    return read_lines(recorder.episode_path(scope, episode))


def assert_recorded_is_sampled(agent, prompt, choice):
    """The recorded reply is exactly the engine's samples spliced with the tool results it was given: every engine
    request of this conversation had as context the recorded prompt and the recorded reply up to there, and what it
    sampled is the recorded reply's next tokens (trained mask 1), with those log-probs."""
    resp, mask = choice["response_ids"], choice["trained_mask"]
    gens = {}  # position in the reply -> what the engine sampled there (n choices share the first context)
    for ctx, ids, lp in agent.engine.log:
        at = len(ctx) - len(prompt)
        if ctx[: len(prompt)] == prompt and resp[:at] == ctx[len(prompt) :] and resp[at : at + len(ids)] == ids:
            gens[at] = (ids, lp)
    assert gens, "the engine never saw the recorded prompt"
    lps = []
    for at, (ids, lp) in sorted(gens.items()):
        assert all(mask[at : at + len(ids)])
        lps += lp
    assert sum(mask) == sum(len(ids) for ids, _ in gens.values())
    assert choice["logprobs"] == lps


def user(text):
    return {"role": "user", "content": text}


def test_recorded_ids_are_what_the_engine_sampled_n_and_streaming(agent, recorder):
    for stream, episode in ((False, "a"), (True, "b")):
        out, events = ask(agent, recorder, [user("What is 2+2?")], episode=episode, stream=stream, n=3)
        [turn] = turns(recorder, episode)
        assert len(turn["choices"]) == 3
        for rec, choice in zip(turn["choices"], out["choices"]):
            assert rec["response_ids"] == choice["message"]["arpo"]["response_ids"]
            assert rec["trained_mask"] == choice["message"]["arpo"]["trained_mask"]
            assert rec["content"] == choice["message"]["content"]
            assert_recorded_is_sampled(agent, turn["prompt_ids"], rec)
            assert rec["unscoreable"] is None and any(m == 0 for m in rec["trained_mask"])  # a tool result inside
            assert choice["message"]["arpo"]["record"] == {
                "recorded": True,
                "episode": f"{SCOPE}/{episode}",
                "turn": 0,
                "segment": 0,
                "continues": False,
                "unscoreable": 0,
            }
            assert choice["logprobs"] is None  # the client did not ask; the record has them anyway
        assert turn["sampling"]["temperature"] == 1.0 and turn["sampling"]["n"] == 3
        assert turn["policy"]["agent"] == "m" and turn["finished"] >= turn["started"]
        if stream:
            done = [p for k, _, p in events if k == "done"]
            assert [d["message"]["arpo"]["record"]["recorded"] for d in done] == [True] * 3


def test_an_eight_turn_conversation_is_one_segment_extending_token_for_token(agent, recorder):
    messages = [user("Compute something.")]
    for k in range(8):
        out, _ = ask(agent, recorder, messages, n=2)
        reply = out["choices"][k % 2]["message"]  # the client goes on with either choice
        messages = [*messages, {"role": "assistant", "content": reply["content"]}, user(f"And now step {k + 1}?")]
    recs = turns(recorder)
    assert [t["turn"] for t in recs] == list(range(8))
    assert {t["segment"] for t in recs} == {0}
    assert [t["continues"] for t in recs] == [False] + [True] * 7
    for k in range(1, 8):
        prev, cur = recs[k - 1], recs[k]
        head = prev["prompt_ids"] + prev["choices"][(k - 1) % 2]["response_ids"]
        assert cur["prompt_ids"][: len(head)] == head  # the recorded reply, tool results included, not re-tokenised
        assert len(cur["prompt_ids"]) > len(head)
        for rec in cur["choices"]:
            assert_recorded_is_sampled(agent, cur["prompt_ids"], rec)
    assert recorder.counts["continued"] == 7 and recorder.counts["new_segments"] == 1


def test_requests_of_one_episode_served_side_by_side_get_their_own_turns(agent, recorder):
    """Two requests continuing the same reply, both begun before either is recorded (a harness that sends an
    episode's requests in parallel): the second recorded follows the first in a segment of its own, so no two turns
    share an index and no segment holds two continuations of one reply; each prompt is what the engine was given."""
    first, _ = ask(agent, recorder, [user("Compute something.")])
    history = [user("Compute something."), {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    jobs = []
    for k in range(2):
        body = {"model": "m", "messages": [*history, user(f"Part {k}?")], "max_tokens": 300, "arpo": {"episode": "ep1"}}
        jobs.append(agent.prepare(parse_chat_request(json.dumps(body)), recorder, SCOPE))
    outs = [agent.run(job, threading.Event(), None) for job in jobs]
    recs = turns(recorder)
    assert [(t["turn"], t["segment"], t["continues"]) for t in recs] == [(0, 0, False), (1, 0, True), (2, 1, False)]
    assert recs[2]["segment_reason"] == "served while turn 1 of the episode was recorded"
    assert [o["choices"][0]["message"]["arpo"]["record"]["turn"] for o in outs] == [1, 2]
    head = recs[0]["prompt_ids"] + recs[0]["choices"][0]["response_ids"]
    for rec in recs[1:]:
        assert rec["prompt_ids"][: len(head)] == head  # both still the recorded ids, as the engine was given them
        assert_recorded_is_sampled(agent, rec["prompt_ids"], rec["choices"][0])
    # the next request that continues the last reply goes on from it
    last = recs[2]["choices"][0]["response_ids"]
    assert last
    messages = [
        *history,
        user("Part 1?"),
        {"role": "assistant", "content": outs[1]["choices"][0]["message"]["content"]},
    ]
    ask(agent, recorder, [*messages, user("Done?")])
    assert (turns(recorder)[-1]["turn"], turns(recorder)[-1]["continues"]) == (3, True)


@pytest.mark.parametrize("agent", [(0, 0)], indirect=True)
def test_without_tool_results_a_continued_prompt_is_the_chat_templates(agent, recorder):
    """Where re-rendering the history gives the same ids (a reply of plain text, a character tokenizer), the
    continued prompt is exactly the chat template's: the reply's end-of-turn mark is neither doubled nor lost."""
    from arpo_algo.rollout.layout import prompt_ids

    messages = [user("Q")]
    for k in range(3):
        out, _ = ask(agent, recorder, messages)
        messages = [*messages, {"role": "assistant", "content": out["choices"][0]["message"]["content"]}, user(f"{k}")]
    recs = turns(recorder)
    assert [t["continues"] for t in recs] == [False, True, True]
    system = {"role": "system", "content": agent.session.system_prompt()}
    assert recs[2]["prompt_ids"] == prompt_ids(agent.tok, [system, *messages[:-2]])


def test_a_client_side_tool_round_continues_even_when_the_client_drops_the_calls_text(agent, recorder):
    """OpenAI's SDKs send an assistant tool call back as ``tool_calls`` with no content: still the recorded reply, so
    the tool result is appended to its recorded ids."""
    out, _ = ask(agent, recorder, [user("Q")], arpo={"episode": "ep1", "tool_mode": "client"})
    msg = out["choices"][0]["message"]
    assert msg["tool_calls"], msg
    back = {"role": "assistant", "content": None, "tool_calls": msg["tool_calls"]}
    result = {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "8"}
    ask(agent, recorder, [user("Q"), back, result], arpo={"episode": "ep1", "tool_mode": "client"})
    first, second = turns(recorder)
    assert second["continues"] and second["segment"] == 0
    head = first["prompt_ids"] + first["choices"][0]["response_ids"]
    assert second["prompt_ids"][: len(head)] == head and len(second["prompt_ids"]) > len(head)


def test_a_rewritten_history_starts_a_new_segment(agent, recorder):
    out, _ = ask(agent, recorder, [user("Compute something.")])
    reply = out["choices"][0]["message"]["content"]
    ask(agent, recorder, [user("Compute something."), {"role": "assistant", "content": reply}, user("More?")])
    summary = [user("Compute something."), {"role": "assistant", "content": "(summarised)"}, user("More?")]
    out, _ = ask(agent, recorder, summary)
    recs = turns(recorder)
    assert [(t["segment"], t["continues"]) for t in recs] == [(0, False), (0, True), (1, False)]
    assert recs[2]["segment_reason"] == "history rewritten"
    assert out["choices"][0]["message"]["arpo"]["record"]["segment"] == 1


def test_unscoreable_turns_are_kept_marked_and_counted(agent, recorder):
    ask(agent, recorder, [user("Q")], episode="short", max_tokens=3)
    ask(agent, recorder, [user("Q")], episode="nucleus", top_p=0.9)
    [short], [nucleus] = turns(recorder, "short"), turns(recorder, "nucleus")
    assert short["choices"][0]["unscoreable"] == "truncated by the length limit"
    assert "top_p 0.9" in nucleus["choices"][0]["unscoreable"]
    assert recorder.counts["unscoreable"] == 2 and recorder.counts["turns"] == 2
    out, _ = ask(agent, recorder, [user("Q")], episode="greedy", temperature=0, n=2)
    assert out["choices"][0]["message"]["arpo"]["record"]["unscoreable"] == 2  # the reply says so too


def test_episodes_are_scoped_to_the_credential_and_ids_are_checked(agent, recorder):
    ask(agent, recorder, [user("Q")], scope=scope_of("alice"))
    ask(agent, recorder, [user("Q")], scope=scope_of("bob"))
    assert len(turns(recorder, scope=scope_of("alice"))) == 1 == len(turns(recorder, scope=scope_of("bob")))
    assert "alice" not in str(recorder.episode_path(scope_of("alice"), "ep1"))
    for bad in ("../x", "", "a" * 129, ".hidden", "a/b", 7):
        with pytest.raises(APIError) as e:
            parse_chat_request(json.dumps({"model": "m", "messages": [user("Q")], "arpo": {"episode": bad}}))
        assert e.value.status == 400 and e.value.param == "arpo.episode"


def test_no_episode_no_record_and_a_full_folder_refuses_turns_but_serves(agent, tmp_path):
    rec = Recorder(RecordConfig(str(tmp_path / "small"), max_bytes=1))
    out, _ = ask(agent, rec, [user("Q")], episode=None)
    assert "record" not in out["choices"][0]["message"]["arpo"]
    ask(agent, rec, [user("Q")])  # the first turn fits (the folder held only its settings)
    out, _ = ask(agent, rec, [user("Q")], episode="second")
    assert out["choices"][0]["message"]["content"]  # served
    assert out["choices"][0]["message"]["arpo"]["record"] == {"recorded": False, "reason": "the record folder is full"}
    assert rec.counts["refused"] == 1 and not rec.episode_path(SCOPE, "second").exists()


def test_the_folder_is_private_and_a_shared_one_is_refused(tmp_path):
    Recorder(RecordConfig(str(tmp_path / "rec")))
    assert stat.S_IMODE((tmp_path / "rec").stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        Recorder(RecordConfig(str(shared)))


def test_a_torn_line_is_skipped_and_a_restart_continues_the_episode(agent, recorder, tmp_path):
    out, _ = ask(agent, recorder, [user("Q")])
    path = recorder.episode_path(SCOPE, "ep1")
    with open(path, "ab") as f:
        f.write(b'{"format": 1, "turn": 1, "prompt_ids": [1, 2')  # a server killed mid-write
    assert len(read_lines(path)) == 1
    fresh = Recorder(RecordConfig(recorder.config.dir))  # a new server process on the same folder
    messages = [user("Q"), {"role": "assistant", "content": out["choices"][0]["message"]["content"]}, user("And?")]
    ask(agent, fresh, messages)
    recs = read_lines(path)
    assert [(t["turn"], t["segment"], t["continues"]) for t in recs] == [(0, 0, False), (1, 0, True)]


def test_rewards_missing_repeated_non_finite_late_and_dropped(agent, recorder):
    ask(agent, recorder, [user("Q")], episode="paid")
    ask(agent, recorder, [user("Q")], episode="never")
    ask(agent, recorder, [user("Q")], episode="late")
    ep = f"{SCOPE}/paid"

    def status(body):
        with pytest.raises(APIError) as e:
            recorder.post_reward(body)
        return e.value.status, e.value.code

    for bad in (math.inf, -math.inf, math.nan, "1", True, None):
        assert status({"episode": ep, "reward": bad})[0] == 400
    assert status({"episode": ep, "reward": 1.0, "turn_rewards": [1.0, 2.0]})[0] == 400
    assert status({"episode": f"{SCOPE}/nobody", "reward": 1.0}) == (404, "not_found")
    assert status({"episode": ep, "reward": 1.0, "extra": 1})[0] == 400
    assert recorder.post_reward({"episode": ep, "reward": 0.5, "turn_rewards": [0.25]})["turns"] == 1
    assert status({"episode": ep, "reward": 1.0}) == (409, "conflict")
    out, _ = ask(agent, recorder, [user("Q")], episode="paid")  # a rewarded episode records nothing more
    assert out["choices"][0]["message"]["arpo"]["record"]["reason"] == "the episode is already rewarded"
    path = recorder.episode_path(SCOPE, "late")
    line = read_lines(path)[0]
    line["finished"] = time.time() - recorder.config.reward_deadline_s - 60
    path.write_text(json.dumps(line) + "\n")
    assert status({"episode": f"{SCOPE}/late", "reward": 1.0}) == (409, "reward_deadline_passed")
    episodes, counts = read_episodes(recorder.config.dir)
    by = {e["episode"].split("/")[1]: e for e in episodes}
    assert by["paid"]["status"] == "rewarded" and by["paid"]["reward"]["reward"] == 0.5
    assert by["never"]["status"] == "pending" and by["late"]["status"] == "dropped"
    assert counts["dropped"] == 1 and counts["rewarded"] == 1 and counts["pending"] == 1
    later = time.time() + recorder.config.reward_deadline_s + 1
    assert read_episodes(recorder.config.dir, now=later)[1]["dropped"] == 2  # "never" too, once past its deadline
