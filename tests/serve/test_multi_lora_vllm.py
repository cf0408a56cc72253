"""Adapter agents on one base with ``engine="vllm"``: the replica's agent set (``serve.agent_set.AgentSet``) in this
process, its shared base a real VLLMEngine with one LoRA request per agent (one vLLM start for the module).

Each answer is compared with the same agent on the HF engine (``serve.runtime.Agent``, PEFT applying the adapter),
greedy: the engine conformance suite shows both engines' greedy tokens equal a teacher-forced float32 forward.
The HTTP layer over the agents is the engine-independent one of ``test_multi_lora.py``.
"""

from __future__ import annotations

import threading

import pytest

from arpo_base.errors import ConfigError

pytestmark = pytest.mark.vllm

SESSION = {"tools": "python", "max_tool_calls": 0}
BODY = {"messages": [{"role": "user", "content": "What is 6 times 7?"}], "temperature": 0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from arpo_algo.models import build_tiny_adapter, build_tiny_model

    root = tmp_path_factory.mktemp("multi_lora_vllm")
    # head_dim 64: vLLM's CPU attention kernels do not take the 16-dim heads of the default tiny model
    base = build_tiny_model(root / "base", num_layers=2, hidden_size=256, seed=0)
    return {
        "base": base,
        "a": build_tiny_adapter(base, root / "a", rank=4, seed=1),
        "b": build_tiny_adapter(base, root / "b", rank=8, seed=2),
        "c": build_tiny_adapter(base, root / "c", rank=4, seed=5),
        "wide": build_tiny_adapter(base, root / "wide", rank=16, seed=3),
    }


def _specs(folders, names, engine="vllm"):
    from serve.agents import build_specs

    return build_specs([f"{n}={folders[n]}" for n in names], engine=engine, max_tokens=16, **SESSION)


def _answer(agent) -> list[int]:
    from serve.schema import parse_chat_request

    result = agent.run(agent.prepare(parse_chat_request({**BODY, "model": agent.spec.name})), threading.Event())
    return result["choices"][0]["message"]["arpo"]["response_ids"]


@pytest.fixture(scope="module")
def agent_set(folders):
    from serve.agent_set import AgentSet

    agents = AgentSet([], drain_s=5.0)
    agents.apply(_specs(folders, ["a", "b"]))
    yield agents
    agents.shared.front.close()


def test_adapter_agents_share_one_vllm_base_and_answer_as_each_alone(agent_set, folders):
    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine
    from serve.runtime import Agent, SharedBase

    engine = agent_set.shared.engine
    assert isinstance(engine, VLLMEngine) and engine.max_lora_rank == 8
    assert engine.llm.llm_engine.vllm_config.lora_config.max_loras == 2  # one LoRA slot per adapter agent
    alone = {name: _answer(agent_set.agents[name]) for name in ("a", "b")}
    together: dict[str, list[int]] = {}
    threads = [
        threading.Thread(target=lambda n=n: together.__setitem__(n, _answer(agent_set.agents[n]))) for n in ("a", "b")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    assert alone["a"] != alone["b"]  # the two adapters differ, and so do their answers
    hf = SharedBase(str(folders["base"]), agent_set.shared.fingerprint, {})
    try:
        for spec in _specs(folders, ["a", "b"], engine="hf"):
            assert _answer(hf.add(spec)) == alone[spec.name]  # what PEFT computes with that adapter
    finally:
        hf.front.close()
    assert isinstance(agent_set.agents["a"], Agent) and agent_set.agents["a"].front is agent_set.shared.front


def test_an_adapter_above_the_engines_max_lora_rank_is_refused_and_nothing_changes(agent_set, folders):
    served = dict(agent_set.agents)
    from serve.agent_set import LoadFailed

    with pytest.raises(
        LoadFailed, match="agent 'wide' failed: .*rank 16 exceeds this vLLM engine's max_lora_rank 8"
    ) as e:
        agent_set.apply(_specs(folders, ["a", "b", "wide"]))
    assert isinstance(e.value.__cause__, ConfigError) and "max_lora_rank" in e.value.__cause__.hint
    assert agent_set.agents == served and set(agent_set.shared.engine.adapters) == {"adapter_0", "adapter_1"}


def test_an_agent_added_live_beyond_max_loras_is_served(agent_set, folders):
    before = {name: _answer(agent_set.agents[name]) for name in ("a", "b")}
    agent_set.apply(_specs(folders, ["a", "b", "c"]))  # a third adapter on an engine started with 2 LoRA slots
    assert agent_set.agents["c"].front is agent_set.shared.front
    alone_c = _answer(agent_set.agents["c"])
    together: dict[str, list[int]] = {}
    threads = [
        threading.Thread(target=lambda n=n: together.__setitem__(n, _answer(agent_set.agents[n])))
        for n in ("a", "b", "c")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == {**before, "c": alone_c} and alone_c not in (before["a"], before["b"])


def test_a_rank_vllm_cannot_serve_is_refused_before_anything_starts(tmp_path):
    from arpo_algo.models import build_tiny_adapter, build_tiny_model
    from serve.agents import build_specs

    base = build_tiny_model(tmp_path / "base", num_layers=1, hidden_size=64, seed=0)
    huge = build_tiny_adapter(base, tmp_path / "huge", rank=513, seed=1)
    with pytest.raises(ConfigError, match="agent 'huge': LoRA rank 513 cannot be served by the vLLM engine") as e:
        build_specs([f"huge={huge}"], engine="vllm", max_tokens=16, **SESSION)
    assert "1, 8, 16, 32, 64, 128, 256, 320, 512" in str(e.value) and "--engine hf" in e.value.hint
    build_specs([f"huge={huge}"], engine="hf", max_tokens=16, **SESSION)  # the HF engine takes any rank
