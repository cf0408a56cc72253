"""What an RLlib user types first either acts or is refused: every AlgorithmConfig field, the inference methods, the
callbacks, and no banner for RLlib machinery arpo does not run."""

from __future__ import annotations

import pytest
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.callbacks.callbacks import RLlibCallback

from arpo_algo.algorithms import ARPOConfig
from arpo_algo.algorithms.rllib_fields import FIRED_CALLBACKS, READ, REFUSED, rllib_defaults
from arpo_base.errors import ArpoError, ConfigError
from tests.arpo_algo.algorithms.test_algorithm import tiny_config


def valid_config() -> ARPOConfig:
    return ARPOConfig().environment("arpo/ToolMath-v0").training(model_path="/nonexistent/model")


def _other(value):
    """A value different from ``value`` of a plausible kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 7  # not 0/1, which equal False/True
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, dict):
        return {**value, "x": 1}
    if isinstance(value, list | tuple):
        return [*value, 1]
    return object()


def test_the_table_covers_every_rllib_field_once():
    fields = set(vars(AlgorithmConfig()))
    assert set(READ) | set(REFUSED) == fields
    assert not set(READ) & set(REFUSED)
    # the dict path's names translate to the same fields
    translated = {
        AlgorithmConfig._translate_special_keys(k, warn_deprecated=False) for k in AlgorithmConfig().to_dict()
    }
    assert translated <= fields


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_every_unread_rllib_field_set_away_from_its_default_is_refused(field):
    cfg = valid_config()
    cfg.validate()  # RLlib's defaults pass
    setattr(cfg, field, _other(rllib_defaults()[field]))
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert field in err.value.message and err.value.hint == REFUSED[field]


@pytest.mark.parametrize(
    "set_it, hint",
    [
        (lambda c: c.env_runners(num_env_runners=2), "num_rollout_actors"),
        (lambda c: c.env_runners(num_cpus_per_env_runner=2), "num_cpus_per_rollout_actor"),
        (lambda c: c.learners(num_learners=2), "learner_workers"),
        (lambda c: c.rl_module(model_config={"fcnet_hiddens": [8]}), "model_path"),
        (lambda c: c.api_stack(enable_rl_module_and_learner=False, enable_env_runner_and_connector_v2=False), "api"),
        (lambda c: c.framework("tf2"), "torch only"),
        (lambda c: c.evaluation(evaluation_duration=20), ".evaluation(every=N"),
        (lambda c: c.evaluation(evaluation_num_env_runners=2), ".evaluation(every=N"),
        (lambda c: c.callbacks(on_episode_end=lambda **kw: None), "on_sample_end"),
        (lambda c: c.update_from_dict({"num_env_runners": 2}), "num_rollout_actors"),
        (lambda c: c.update_from_dict({"gamma": 0.9}), "undiscounted"),
    ],
)
def test_rllib_setters_users_reach_for_are_refused_naming_arpos_equivalent(set_it, hint):
    cfg = set_it(valid_config())
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert hint in err.value.hint


def test_the_fields_arpo_reads_keep_working_and_the_dict_path_round_trips():
    cfg = valid_config().debugging(seed=7).evaluation(evaluation_interval=3)
    cfg.resources(num_cpus_for_main_process=2, placement_strategy="SPREAD")
    cfg.validate()
    back = ARPOConfig().update_from_dict(cfg.to_dict())
    back.validate()
    assert (back.seed, back.settings.evaluation.every, back.num_cpus_for_main_process) == (7, 3, 2)


def test_a_callbacks_class_with_episode_callbacks_is_refused():
    class Episodes(RLlibCallback):
        def on_episode_end(self, **kwargs):
            pass

    with pytest.raises(ConfigError) as err:
        valid_config().callbacks(Episodes).validate()
    assert "on_episode_end" in err.value.message and "on_sample_end" in err.value.hint


class Counting(RLlibCallback):
    """Counts each callback arpo fires, with what it received."""

    calls: dict[str, list[dict]] = {}

    def _count(self, name, kwargs):
        type(self).calls.setdefault(name, []).append(kwargs)

    def on_algorithm_init(self, **kwargs):
        self._count("on_algorithm_init", kwargs)

    def on_sample_end(self, **kwargs):
        self._count("on_sample_end", kwargs)

    def on_train_result(self, **kwargs):
        self._count("on_train_result", kwargs)

    def on_evaluate_start(self, **kwargs):
        self._count("on_evaluate_start", kwargs)

    def on_evaluate_end(self, **kwargs):
        self._count("on_evaluate_end", kwargs)

    def on_checkpoint_loaded(self, **kwargs):
        self._count("on_checkpoint_loaded", kwargs)


BANNER_CHECK = """
import logging
from ray.rllib.algorithms.ppo import PPOConfig
from arpo_algo.algorithms import ARPOConfig

messages = []
class Records(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())

# RLlib logs the banner once per process and algorithm name, under "ray.rllib" (which does not propagate to the root
# logger): listen there
logging.getLogger("ray.rllib").addHandler(Records(logging.DEBUG))
ARPOConfig().environment("arpo/ToolMath-v0").training(model_path="/nonexistent/model").validate()
PPOConfig().environment("CartPole-v1").validate()  # RLlib's own algorithm logs it: the listener hears it
print([m for m in messages if "on the new API stack" in m])
"""


def test_validation_logs_no_api_stack_banner():
    """In a fresh process: RLlib's once-per-process marks and the loggers other tests configured are not this
    test's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", BANNER_CHECK], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    banners = out.stdout.strip().splitlines()[-1]
    assert banners.count("on the new API stack") == 1 and "running PPO" in banners, out.stdout


def test_callbacks_fire_over_one_iteration_with_evaluation_and_a_restore(tiny_model_dir, tmp_path):
    Counting.calls = {}
    algo = tiny_config(tiny_model_dir).evaluation(every=1, num_prompts=1).callbacks(Counting).build_algo()
    try:
        result = algo.train()
        algo.load_checkpoint(algo.save_to_path(str(tmp_path / "ckpt")))  # Tune's restore path
        for name in ("get_module", "get_policy"):
            with pytest.raises(ArpoError) as err:
                getattr(algo, name)()
            assert "arpo serve" in err.value.hint and "algo.learner.model" in err.value.hint
        # RLlib's inference methods answer a prompt as the served agent would: greedy, so the same answer every time,
        # and a batch answers each prompt as it is answered alone
        answer = algo.compute_single_action("What is 2 + 3?")
        assert isinstance(answer, str) and answer == algo.compute_single_action("What is 2 + 3?")
        both = algo.compute_actions({"a": "What is 2 + 3?", "b": "What is 7 * 6?"})
        assert both == {"a": answer, "b": algo.compute_single_action("What is 7 * 6?")}
        with pytest.raises(ArpoError, match="str"):
            algo.compute_single_action([0.1, 0.2])
        with pytest.raises(ArpoError, match="full_fetch"):
            algo.compute_single_action("What is 2 + 3?", full_fetch=True)
    finally:
        algo.stop()
    calls = Counting.calls
    assert {name: len(calls.get(name, [])) for name in FIRED_CALLBACKS} == dict.fromkeys(FIRED_CALLBACKS, 1)
    assert calls["on_algorithm_init"][0]["algorithm"] is algo
    samples = calls["on_sample_end"][0]["samples"]  # the iteration's groups, one per prompt
    assert len(samples) == 1 and len(samples[0].trajectories) == 2
    assert calls["on_evaluate_end"][0]["evaluation_metrics"]["num_tasks"] == 1.0
    assert calls["on_train_result"][0]["result"]["training_iteration"] == result["training_iteration"] == 1


def test_ray_can_export_every_algorithm_class():
    # Ray disassembles an actor class before exporting it (a Tune trial's Algorithm); the config and Algorithm
    # classes name each other, and as plain class attributes that cycle recursed without end.
    import dis
    import io

    from arpo_algo.algorithms.variants import VARIANTS

    for variant in VARIANTS.values():
        dis.dis(variant.algorithm, file=io.StringIO(), depth=2)
        assert variant.algorithm.config_class is variant.config_class
        assert variant.config_class().algo_class is variant.algorithm
