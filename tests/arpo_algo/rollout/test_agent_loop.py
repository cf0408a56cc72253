"""run_agents (the agent loop) against the tree sampler: same seeds, same tokens; streaming hooks; the layout rule."""

from __future__ import annotations

import pytest

from arpo_algo.core import tree as T
from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout import layout
from arpo_algo.rollout.agent_loop import run_agents
from arpo_algo.rollout.engines.base import SamplingParams
from arpo_algo.rollout.sampler import TreeSampler
from arpo_env.core import ToolTextEnv
from arpo_env.session import ToolSession

from .test_sampler import ScriptedEngine

SEED, STEP, TASKS, BUDGET = 11, 3, (0, 4), 3


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    return {
        "python": {},
        "cache": {"path": str(tmp_path_factory.mktemp("alcache") / "py.sqlite"), "mode": "read_write"},
    }


def _grpo_then_agents(engine, tools, max_response_tokens):
    """The same conversations twice: as a GRPO TreeSampler step and through run_agents with the sampler's seeds."""
    creator = lambda: ToolTextEnv(task="toolmath", tools=tools)  # noqa: E731
    sampler = TreeSampler(
        engine, creator, TreeConfig.grpo(BUDGET), SamplingParams(), max_response_tokens=max_response_tokens, seed=SEED
    )
    groups, _ = sampler.sample(list(TASKS), step=STEP)
    sampler.close()
    tok = engine.tokenizer
    sessions, prompts, seeds = [], [], []
    for ti in TASKS:
        env = creator()
        _, info = env.reset(options={"task_index": ti})
        for tid in range(BUDGET):
            sessions.append(ToolSession(tools=env.tools, max_tool_calls=env.config["max_tool_calls"]))
            prompts.append(layout.prompt_ids(tok, info["messages"]))
            seeds.append(lambda n, ti=ti, tid=tid: T.derive_seed(SEED, STEP, ti, tid, n))
    traces = run_agents(
        engine,
        sessions,
        prompts,
        SamplingParams(),
        max_response_tokens=max_response_tokens,
        seeds=seeds,
        tool_workers=2,
    )
    return [t for g in groups for t in g.trajectories], [g.prompt_ids for g in groups for _ in range(BUDGET)], traces


def _assert_same(trajs, prompts, traces):
    assert len(trajs) == len(traces)
    for t, p, a in zip(trajs, prompts, traces):
        assert a.prompt_ids == p
        assert a.response_ids == t.response_ids and a.trained_mask == t.trained_mask
        assert a.logprobs == t.old_logprobs and a.entropies == t.entropies
        assert a.finish_reason == t.finish_reason
        assert [c["output"] for c in a.tool_calls] == [c["output"] for c in t.tool_calls]


def test_run_agents_reproduces_grpo_tiny_model(tiny_model_dir, tools):
    """A real tiny model through the HF engine, the real toolmath env and python tool: identical tokens."""
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    _assert_same(*_grpo_then_agents(HFEngine(str(tiny_model_dir)), tools, max_response_tokens=48))


def test_run_agents_reproduces_grpo_with_tool_calls(tools):
    """Tool-using turns (real python tool runs): the scripted engine writes calls; tool results must match too."""
    trajs, prompts, traces = _grpo_then_agents(ScriptedEngine(), tools, max_response_tokens=400)
    assert sum(len(a.tool_calls) for a in traces) > 0
    assert {a.finish_reason for a in traces} >= {"answer"}
    _assert_same(trajs, prompts, traces)


def test_events_and_token_stream(tiny_model_dir):
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    eng = HFEngine(str(tiny_model_dir))
    sessions = [ToolSession(), ToolSession()]
    prompt = layout.prompt_ids(
        eng.tokenizer,
        [{"role": "system", "content": sessions[0].system_prompt()}, {"role": "user", "content": "What is 6 * 7?"}],
    )
    events: list[tuple[int, dict]] = []
    streamed: dict[int, list[int]] = {0: [], 1: []}
    traces = run_agents(
        eng,
        sessions,
        [prompt, prompt],
        SamplingParams(seed=1),
        max_response_tokens=30,
        on_event=lambda i, e: events.append((i, e)),
        on_token=lambda i, t: streamed[i].append(t),
    )
    for i, tr in enumerate(traces):
        assert streamed[i] == [t for t, m in zip(tr.response_ids, tr.trained_mask) if m]
        done = [e for j, e in events if j == i and e["type"] == "done"]
        assert done == [{"type": "done", "finish_reason": tr.finish_reason}]
        assert len([e for j, e in events if j == i and e["type"] == "tool_call"]) == len(tr.tool_calls)
        assert len(tr.response_ids) <= 30 and tr.text == eng.tokenizer.decode(tr.response_ids, skip_special_tokens=True)


def test_run_agents_checks_lengths():
    with pytest.raises(ValueError, match="same length"):
        run_agents(ScriptedEngine(), [ToolSession()], [[1], [2]], SamplingParams(), max_response_tokens=4)


def test_layout_rule(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [{"role": "user", "content": "hi"}]
    assert layout.prompt_ids(tok, msgs) == list(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    ids = layout.observation_ids(tok, " <result>\n<|im_end|>\n</result>")
    assert tok.eos_token_id not in ids and tok.decode(ids) == " <result>\n<|im_end|>\n</result>"
    assert layout.observation_ids(tok, "") == [] and layout.text_ids(tok, "<|im_end|>") == [tok.eos_token_id]


def test_the_tool_limit_eos_never_takes_a_response_past_its_budget():
    """The EOS appended when a call goes over the tool-call limit is added only while there is room: a call that
    ends exactly at max_response_tokens keeps the response at the budget (it used to end one token past it, so a
    prompt at its own limit gave a trained sequence longer than the context)."""
    from arpo_algo.rollout.agent_loop import Conversation, Turn, apply_turn

    over_limit = Turn(observation="", done=True, truncated=False, action_kind="tool_call", append_eos=True)
    for budget, want in ((4, [1, 2, 3, 4]), (5, [1, 2, 3, 4, 0])):
        conv = Conversation()
        conv.add([1, 2, 3, 4], [1] * 4, [-0.1] * 4, [0.0] * 4)
        status, reason = apply_turn(conv, over_limit, tokenizer=None, eos_id=0, max_response_tokens=budget)
        assert (status, conv.response, len(conv.mask), len(conv.logprobs)) == ("finished", want, len(want), len(want))
