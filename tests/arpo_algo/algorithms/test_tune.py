"""ARPO inside Ray: a one-trial Tune run (metrics, checkpoint, from_checkpoint), rollout actors, infeasible trials."""

from __future__ import annotations

import time

import pytest

from arpo_algo.algorithms import ARPO, ARPOConfig
from arpo_base.errors import ConfigError


@pytest.fixture(scope="module")
def ray_local():
    import ray

    if ray.is_initialized():  # left by a test that failed elsewhere: one failure must not cascade
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def tiny_config(model_dir) -> ARPOConfig:
    return (
        ARPOConfig()
        .environment("arpo/ToolMath-v0", env_config={"levels": [1], "max_tool_calls": 1})
        .training(model_path=str(model_dir), prompts_per_step=1, lr=1e-4)
        .tree(budget=2, initial=1)
        .llm_rollouts(max_response_tokens=12, hf={"max_batch_size": 4})
    )


def test_one_trial_tuner(ray_local, tiny_model_dir, tmp_path):
    from ray import tune

    param_space = tiny_config(tiny_model_dir).training(lr=tune.choice([1e-4, 3e-4])).debugging(seed=1)
    tuner = tune.Tuner(
        ARPO,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            num_samples=1, metric="reward_mean", mode="max", trial_dirname_creator=lambda t: f"arpo_{t.trial_id}"
        ),
        run_config=tune.RunConfig(
            name="t",
            storage_path=str(tmp_path),
            stop={"training_iteration": 1},
            verbose=0,
            checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=True, num_to_keep=1),
        ),
    )
    results = tuner.fit()
    assert not results.errors
    best = results.get_best_result()
    assert best.metrics["training_iteration"] == 1
    assert "reward_mean" in best.metrics and "rollout" in best.metrics
    assert best.config["training.lr"] in (1e-4, 3e-4)  # the dotted name, as in sweep files
    assert (tmp_path / "t").is_dir() and any(p.name.startswith("arpo_") for p in (tmp_path / "t").iterdir())
    algo = ARPO.from_checkpoint(best.checkpoint.path)
    try:
        assert algo.iteration == 1 and algo.config.settings.training.lr == best.config["training.lr"]
    finally:
        algo.stop()


def test_infeasible_trial_fails_fast(ray_local, tiny_model_dir, tmp_path):
    from ray import tune

    cfg = tiny_config(tiny_model_dir).llm_rollouts(num_rollout_actors=2)  # 1 + 2 CPUs on a 2-CPU cluster
    t0 = time.time()
    with pytest.raises(ConfigError, match="needs 3 CPUs"):
        tune.Tuner(
            ARPO,
            param_space=cfg,
            tune_config=tune.TuneConfig(trial_dirname_creator=lambda t: t.trial_id),
            run_config=tune.RunConfig(
                name="inf", storage_path=str(tmp_path), verbose=0, stop={"training_iteration": 1}
            ),
        ).fit()
    assert time.time() - t0 < 60  # fails at once, not a trial left pending forever


def test_rollout_actor_pool_path(ray_local, tiny_model_dir):
    cfg = tiny_config(tiny_model_dir).llm_rollouts(num_rollout_actors=1, num_cpus_per_rollout_actor=1)
    algo = cfg.build_algo()
    try:
        assert type(algo.engine).__name__ == "RolloutActorPool"
        result = algo.train()
        assert result["num_trajectories"] == 2.0
    finally:
        algo.stop()
