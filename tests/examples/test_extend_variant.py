"""The worked example ``examples/extend/variant.py``: one module and one registration line make a variant that the
experiment files, the registry and RLlib know, and that trains on the tiny model."""

from __future__ import annotations

import pytest

from arpo_algo.algorithms import ALGORITHMS, CONFIG_CLASSES, VARIANTS, ARPOConfig, register_variant
from arpo_algo.algorithms.settings import Settings
from arpo_algo.run.experiment import load_experiment
from arpo_base.errors import ConfigError
from examples.extend.variant import ArpoCode, ArpoCodeConfig


def test_the_registration_line_feeds_every_lookup():
    assert CONFIG_CLASSES["arpo_code"] is ArpoCodeConfig and ALGORITHMS["arpo_code"] is ArpoCode
    v = VARIANTS["arpo_code"]
    assert v.tree_mode == "arpo" and set(v.changes) == set(v.defaults) == {"tree.decision_rule", "tree.fillup"}
    assert ArpoCode.get_default_config().algo_class is ArpoCode and ArpoCodeConfig().algo_class is ArpoCode
    settings = Settings.for_variant("arpo_code")
    assert (settings.tree.decision_rule, settings.tree.fillup) == ("reference", "trickle")
    assert settings.tree.policy_name == "reference"
    with pytest.raises(ValueError, match="already registered"):
        register_variant(ArpoCodeConfig, ArpoCode)
    with pytest.raises(ConfigError, match="unknown algorithm 'arpo_cod'"):
        Settings.for_variant("arpo_cod")


def test_an_experiment_file_names_it(tiny_model_dir):
    exp = load_experiment(
        sections={
            "experiment": {"algorithm": "arpo_code"},
            "model": {"path": str(tiny_model_dir)},
            "env": {"id": "arpo/ToolMath-v0"},
        },
        overrides=["tree.fillup=batch"],
    )
    assert type(exp.config) is ArpoCodeConfig and exp.config.settings.tree.decision_rule == "reference"
    assert exp.config.settings.tree.fillup == "batch"  # the preset is a default like any other


def test_it_trains_one_iteration_on_the_tiny_model(tiny_model_dir):
    cfg = (
        ArpoCodeConfig()
        .environment("arpo/ToolMath-v0", env_config={"levels": [1], "max_tool_calls": 1})
        .training(model_path=str(tiny_model_dir), prompts_per_step=1, lr=1e-4, entropy_coef=0.01)
        .llm_rollouts(max_response_tokens=16, hf={"max_batch_size": 4})
        .tree(budget=2, initial=1)
    )
    algo = cfg.build_algo()
    try:
        assert isinstance(algo, ArpoCode) and isinstance(algo.config, ArpoCodeConfig)
        assert algo.sampler.cfg.decision_rule == "reference"
        result = algo.train()
    finally:
        algo.stop()
    assert result["training_iteration"] == 1 and result["num_trajectories"] == 2.0
    assert result["learner"]["param_change_norm"] > 0  # the entropy bonus always has a gradient: a real update
    assert isinstance(cfg, ARPOConfig)


def test_tune_finds_it_by_name():
    """``tune.Tuner("ArpoCode")`` or ``tune.Tuner("ARPO_CODE")``: the registration line registers it with Tune too."""
    from ray.tune.registry import get_trainable_cls

    assert get_trainable_cls("ArpoCode") is ArpoCode and get_trainable_cls("ARPO_CODE") is ArpoCode
