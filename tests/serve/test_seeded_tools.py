"""A served request with a ``seed`` runs its persistent interpreters from the seeds training gives the same
trajectories, so their ``random`` and numpy draws are training's; without a seed they come from the OS."""

from __future__ import annotations

import json
import threading

from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout.engines.base import SamplingParams
from arpo_algo.rollout.sampler import TreeSampler
from arpo_env.core import ToolTextEnv
from serve.agents import AgentSpec
from serve.batching import BatchingEngine
from serve.runtime import Agent
from serve.schema import parse_chat_request
from tests.arpo_algo.rollout.test_sampler import DRAW, ScriptedEngine

SESSION = {"max_tool_calls": 3, "tools": {"python": {"persistent": True}}}
ENV = {"task": "toolmath", "levels": [1], **SESSION}


def _engine():
    return ScriptedEngine(calls=(1, 3), call=DRAW)


def _served(messages, n, seed):
    agent = Agent(AgentSpec(name="m", model_path="", session=SESSION), front=BatchingEngine(_engine()))
    body = {"model": "m", "messages": messages, "temperature": 1.0, "n": n, "max_tokens": 400}
    if seed is not None:
        body["seed"] = seed
    try:
        out = agent.run(agent.prepare(parse_chat_request(json.dumps(body).encode())), threading.Event())
    finally:
        agent.front.close()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    return [[c["output"] for c in ch["message"]["arpo"]["tool_calls"]] for ch in choices]


def test_a_seeded_request_draws_what_training_draws_and_an_unseeded_one_does_not():
    seed, n = 1234, 2
    sampler = TreeSampler(
        _engine(), lambda: ToolTextEnv(ENV), TreeConfig.grpo(n), SamplingParams(temperature=1.0),
        max_response_tokens=400, seed=seed,
    )  # fmt: skip
    try:
        groups, _ = sampler.sample([0], step=0)
    finally:
        sampler.close()
    trained = [[c["output"] for c in t.tool_calls] for t in groups[0].trajectories]
    env = ToolTextEnv(ENV)
    _, info = env.reset(options={"task_index": 0})
    served = _served(info["messages"], n, seed)
    assert all(served) and served == trained
    assert served[0][0] != served[1][0]  # each choice has its own seed
    assert _served(info["messages"], n, None)[0][0] not in {o[0] for o in trained}
