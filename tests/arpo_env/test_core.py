"""ToolTextEnv: config handling, observations, limits, clone, registration (real Python tool)."""

from __future__ import annotations

import gymnasium as gym
import pytest

import arpo_env
from arpo_base.errors import ArpoError, ConfigError
from arpo_env.core import ToolTextEnv

CALL = "<think>compute</think> <python>print(6*7)</python>"
ANSWER = "<think>done</think> <answer>\\boxed{42}</answer>"


@pytest.fixture(scope="module")
def env() -> ToolTextEnv:
    return ToolTextEnv(task="toolmath", num_tasks=50)


def test_dict_and_kwargs_config_and_errors():
    a = ToolTextEnv({"task": "toolmath", "max_tool_calls": 2})
    b = ToolTextEnv(task="toolmath", max_tool_calls=2)
    assert a.config == b.config and a.config["max_tool_calls"] == 2
    with pytest.raises(ConfigError, match="'max_tool_cals'") as err:
        ToolTextEnv(task="toolmath", max_tool_cals=2)
    assert err.value.hint == "did you mean 'max_tool_calls'?"  # the closest valid name, as every config says it
    with pytest.raises(ConfigError, match="task 'toolmath'.*'keep_boxed_bug'"):
        ToolTextEnv(task="toolmath", keep_boxed_bug=True)  # a reference-data key on a generated task
    with pytest.raises(ConfigError, match="on_tool_limit='explode' is not one of 'end_with_eos'"):
        ToolTextEnv(task="toolmath", on_tool_limit="explode")
    with pytest.raises(ConfigError, match="reward='gsm8k'"):
        ToolTextEnv(task="toolmath", reward="gsm8k")
    with pytest.raises(ConfigError, match="max_turns must be a positive integer"):
        ToolTextEnv(task="toolmath", max_turns=0)
    with pytest.raises(ConfigError, match="task given twice"):
        ToolTextEnv({"task": "toolmath"}, task="reasoning")
    with pytest.raises(ConfigError, match="task='toolmat'") as err:
        ToolTextEnv(task="toolmat")
    assert err.value.hint == "did you mean 'toolmath'?"


def test_observation_is_exactly_the_appended_text(env):
    question, info = env.reset(options={"task_index": 3})
    assert info["messages"][1] == {"role": "user", "content": question}
    assert info["task"]["question"] == question and "ground_truth" not in info["task"]  # withheld by default
    assert env.observation_space.contains(question)
    obs, reward, terminated, truncated, info = env.step(CALL)
    assert obs == " <result>\n42\n</result>" and reward == 0.0 and not terminated and not truncated
    assert info["tool"] == "python" and info["args"] == {"code": "print(6*7)"} and info["tool_calls"] == 1
    assert info["parse_status"] == "ok" and info["tool_error"] is False and info["latency_s"] > 0
    obs, reward, terminated, truncated, info = env.step(ANSWER)
    assert obs == "" and terminated and not truncated
    assert env.response == CALL + " <result>\n42\n</result>" + ANSWER
    assert info["reward_info"]["reward_name"] == "math_equiv" and info["reward_info"]["answer"] == "42"
    with pytest.raises(ArpoError, match="reset"):
        env.step(ANSWER)


def test_plain_text_ends_episode_and_tool_errors_are_observations(env):
    env.reset(seed=0)
    obs, _r, terminated, _t, info = env.step("<python>1/0</python>")
    assert "ZeroDivisionError" in obs and info["tool_error"] and not terminated
    _obs, reward, terminated, _t, info = env.step("I give up.")
    assert terminated and reward == 0.0 and info["kind"] == "text"


def test_tool_limit_end_with_eos_and_error_observation():
    e = ToolTextEnv(task="toolmath", max_tool_calls=1)
    e.reset(seed=0)
    e.step(CALL)
    obs, reward, terminated, _t, info = e.step(CALL)
    assert terminated and info["append_eos"] and obs == "" and info["limit_hits"] == 1
    assert reward == 0.0  # no answer: math_equiv's format_penalty (0.0 by default)
    e2 = ToolTextEnv(task="toolmath", max_tool_calls=1, on_tool_limit="error_observation")
    e2.reset(seed=0)
    e2.step(CALL)
    obs, _r, terminated, _t, info = e2.step(CALL)
    assert not terminated and "limit" in obs and info["tool_calls"] == 1 and info["tool_output"] is None
    assert e2.step(ANSWER)[2]


def test_invalid_calls_continue_or_end():
    e = ToolTextEnv(task="toolmath")
    e.reset(seed=0)
    obs, _r, terminated, _t, info = e.step("<python></python>")
    assert not terminated and obs.startswith(" <result>\nError: empty") and info["invalid_actions"] == 1
    e2 = ToolTextEnv(task="toolmath", on_invalid_call="end")
    e2.reset(seed=0)
    assert e2.step("<python></python>")[2]


def test_max_turns_truncates_and_result_cap():
    e = ToolTextEnv(task="toolmath", max_turns=2, max_result_chars=10)
    e.reset(seed=0)
    obs, *_ = e.step("<python>print('x' * 100)</python>")
    assert obs == " <result>\n" + "x" * 10 + "\n[... truncated 90 characters]\n</result>"
    obs, _r, terminated, truncated, info = e.step(CALL)
    assert truncated and not terminated and obs == "" and info["tool_calls"] == 1  # the 2nd call did not run
    assert "reward_info" in info


def test_clone_is_independent_and_reuses_tool_results(env):
    env.reset(seed=5)
    env.step(CALL)
    twin = env.clone()
    assert twin.response == env.response and twin._task == env._task and twin.tools is env.tools
    assert twin.np_random.integers(1 << 30) == env.np_random.integers(1 << 30)  # same RNG state, own copy
    obs, *_ = twin.step("<python>print(1+1)</python>")
    assert obs == " <result>\n2\n</result>"
    assert twin.session.counts["tool_calls"] == 2 and env.session.counts["tool_calls"] == 1
    assert env.response.count("<result>") == 1
    _o, r_env, term, _t, _i = env.step(ANSWER)
    assert term and twin._done is False


def test_registered_ids_idempotent_and_make_with_config():
    before = dict(gym.registry)
    arpo_env.register_envs()
    assert dict(gym.registry).keys() == before.keys()
    for env_id in ("arpo/ToolMath-v0", "arpo/Reasoning-v0", "arpo/DeepSearch-v0"):
        assert env_id in gym.registry
    e = gym.make("arpo/ToolMath-v0", config={"max_tool_calls": 2})
    assert e.unwrapped.config["max_tool_calls"] == 2
    e = gym.make("arpo/ToolMath-v0", max_tool_calls=3, split="test")
    assert e.unwrapped.config["split"] == "test"


def test_json_protocol_env():
    e = ToolTextEnv(task="toolmath", protocol="json")
    _q, info = e.reset(seed=0)
    assert "<tools>" in info["messages"][0]["content"] and e.stop_sequences == ("</tool_call>",)
    obs, *_ = e.step('<tool_call>{"name": "python", "arguments": {"code": "print(5)"}}</tool_call>')
    assert obs == "\n<tool_response>\n5\n</tool_response>\n"


def test_ray_tune_register_env():
    pytest.importorskip("ray.tune")
    from ray.rllib.env.env_context import EnvContext
    from ray.tune.registry import ENV_CREATOR, _global_registry, register_env

    register_env("arpo_toolmath_test", lambda cfg: ToolTextEnv(cfg))
    creator = _global_registry.get(ENV_CREATOR, "arpo_toolmath_test")
    e = creator(EnvContext({"task": "toolmath", "max_tool_calls": 2}, worker_index=0))
    q, _ = e.reset(seed=0)
    assert isinstance(q, str) and e.config["max_tool_calls"] == 2
