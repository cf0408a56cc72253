"""The worked example of adding a rollout engine (``examples/extend/engine.py``): its one registration line makes it a
choice of ``rollouts.engine`` (checked by its capabilities), of ``build_engine`` and of the CLI, and a real tree
sampler step on the tiny model runs through it with the trees the HF engine it wraps gives for the same seed."""

from __future__ import annotations

import pytest

from arpo_algo.algorithms import ARPOConfig
from arpo_algo.algorithms.settings import Settings
from arpo_algo.rollout.engines import build_engine, engine_names
from arpo_algo.rollout.sampler import TreeSampler
from arpo_base.errors import ConfigError
from arpo_env.core import ToolTextEnv
from examples.extend.engine import RecordingEngine


def _settings(engine: str, **tree):
    cfg = ARPOConfig().environment("arpo/ToolMath-v0").training(model_path="/nonexistent/model")
    cfg = cfg.llm_rollouts(engine=engine, max_response_tokens=40).tree(budget=4, initial=2, branch_factor=1, **tree)
    cfg.validate()
    return cfg.settings


def _trees(engine, settings):
    sampler = TreeSampler.from_config(
        engine, lambda: ToolTextEnv(task="toolmath", tools={"python": {}}), settings.tree, settings.rollouts, seed=5
    )
    groups, _ = sampler.sample([0, 1], step=1)
    sampler.close()
    return [[(t.response_ids, t.parent, t.branch_point, t.finish_reason) for t in g.trajectories] for g in groups]


def test_the_registered_engine_samples_trees_like_the_engine_it_wraps(tiny_model_dir):
    assert "recording" in engine_names()  # the CLI's --engine choices come from the registry
    settings = _settings("recording")
    assert settings.rollouts.engine_spec.constructor is RecordingEngine
    engine = build_engine(settings.rollouts.engine, model_or_path=str(tiny_model_dir), seed=5)
    assert isinstance(engine, RecordingEngine)
    trees = _trees(engine, settings)
    assert engine.served and all(prompt > 0 for _, prompt, _ in engine.served)
    hf = build_engine("hf", model_or_path=str(tiny_model_dir), max_batch_size=8, seed=5)
    assert trees == _trees(hf, _settings("hf"))


def test_the_settings_check_its_capabilities_not_its_name():
    """It declares no LoRA, so LoRA is refused naming it; an unknown engine is refused naming the closest."""
    lora = Settings().update({"model.path": "unused", "model.lora.enabled": True, "rollouts.engine": "recording"})
    with pytest.raises(ConfigError, match="the recording engine cannot serve LoRA adapters"):
        lora.validate()
    cfg = ARPOConfig().environment("arpo/ToolMath-v0").training(model_path="/nonexistent/model")
    with pytest.raises(ConfigError, match="recordng") as e:
        cfg.llm_rollouts(engine="recordng")
    assert "recording" in e.value.hint
