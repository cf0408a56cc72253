"""``.environment(env=...)`` takes what RLlib's takes: a Gymnasium id, a ``tune.register_env`` name, an env class or a
creator; each makes the ToolTextEnv arpo's sampler drives, and anything else is refused saying what it made."""

from __future__ import annotations

import gymnasium as gym
import pytest
from ray import tune

from arpo_algo.algorithms import ARPOConfig
from arpo_algo.algorithms.components import env_creator
from arpo_base.errors import ConfigError
from arpo_env.core import ToolTextEnv

ENV_CONFIG = {"task": "toolmath", "levels": [1], "max_tool_calls": 1}


def _made(env) -> ToolTextEnv:
    cfg = ARPOConfig().environment(env, env_config=ENV_CONFIG)
    made = env_creator(cfg, split="test")()
    assert isinstance(made, ToolTextEnv)
    assert made.config["levels"] == [1] and made.config["max_tool_calls"] == 1 and made.config["split"] == "test"
    return made


def test_gymnasium_id():
    _made("arpo/ToolMath-v0")


def test_tune_registered_name():
    tune.register_env("toolmath_by_tune", lambda ctx: ToolTextEnv(ctx))  # RLlib hands the creator an EnvContext
    _made("toolmath_by_tune")


def test_env_class():
    _made(ToolTextEnv)


def test_creator():
    _made(lambda ctx: ToolTextEnv(dict(ctx)))


def test_not_a_text_env_is_refused():
    tune.register_env("cartpole_by_tune", lambda ctx: gym.make("CartPole-v1"))
    with pytest.raises(ConfigError, match="made a CartPoleEnv; arpo's sampler drives arpo_env.ToolTextEnv"):
        env_creator(ARPOConfig().environment("cartpole_by_tune"))()


def test_unknown_name_is_refused():
    with pytest.raises(ConfigError, match="cannot be made"):
        env_creator(ARPOConfig().environment("no_such_env_anywhere"))()


def test_train_with_a_class_and_a_checkpoint_needs_a_name(tiny_model_dir, tmp_path):
    """An env class trains as a Gymnasium id does; a checkpoint names its environment (it holds no code), so saving
    one asks for a registered name."""
    cfg = (
        ARPOConfig()
        .environment(ToolTextEnv, env_config=ENV_CONFIG)
        .training(model_path=str(tiny_model_dir), prompts_per_step=1)
        .tree(budget=2, initial=1)
        .llm_rollouts(max_response_tokens=8, hf={"max_batch_size": 4}, record_trees=False)
    )
    algo = cfg.build_algo()
    try:
        assert algo.train()["env_runners"]["num_episodes"] == 2.0
        with pytest.raises(ConfigError, match="records its environment by name"):
            algo.save_to_path(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
