"""The task registry: a new task family is one TaskSpec; env config, Gymnasium ids and defaults follow from it."""

from __future__ import annotations

import gymnasium as gym
import pytest

import arpo_env
from arpo_base.errors import ConfigError
from arpo_env.core import ToolTextEnv, resolve_config
from arpo_env.tasks.registry import TASKS, TaskSpec, register_task


def _two_sums(cfg):
    return [
        {
            "id": f"s{i}",
            "question": f"What is {i} + {cfg['offset']}?",
            "ground_truth": str(i + cfg["offset"]),
            "split": cfg["split"],
            "reward_kwargs": {},
        }
        for i in range(2)
    ]


def test_a_new_task_touches_one_place():
    spec = TaskSpec("arpo/TwoSums-v0", ("python",), "math_equiv", 2, _two_sums, {"offset": 10})
    register_task("twosums", spec)
    try:
        arpo_env.register_envs()
        assert arpo_env.ENV_IDS["arpo/TwoSums-v0"] == {"task": "twosums"}
        env = gym.make("arpo/TwoSums-v0", offset=5).unwrapped
        question, info = env.reset(options={"task_index": 1})
        assert question == "What is 1 + 5?" and env.config["max_tool_calls"] == 2
        obs, *_ = env.step("<python>print(1 + 5)</python>")
        assert "6" in obs
        _, reward, term, _, _ = env.step("<answer>\\boxed{6}</answer>")
        assert term and reward == 1.0
        with pytest.raises(ConfigError, match="levels"):
            resolve_config(task="twosums", levels=[1])  # another family's key
    finally:
        TASKS.pop("twosums")
        arpo_env.ENV_IDS.pop("arpo/TwoSums-v0")
        gym.registry.pop("arpo/TwoSums-v0")


def test_registry_matches_the_builtin_families():
    assert {s.env_id for s in TASKS.values()} >= {"arpo/ToolMath-v0", "arpo/Reasoning-v0", "arpo/DeepSearch-v0"}
    assert set(arpo_env.DATA_BACKED) == {"arpo/Reasoning-v0", "arpo/DeepSearch-v0"}
    assert ToolTextEnv(task="toolmath").config["max_tool_calls"] == TASKS["toolmath"].max_tool_calls
    with pytest.raises(ConfigError, match="toolmath"):
        resolve_config(task="toolmaths")
    with pytest.raises(ConfigError, match="already registered"):
        register_task("toolmath", TaskSpec("x", (), "math_equiv", 1, _two_sums))
