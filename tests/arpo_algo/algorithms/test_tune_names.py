"""What Tune and RLlib users type first: a trial by registered name, RLlib's result names, arpo's settings in
``params.json``, short trial folders, the trial's trees in its own folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from arpo_algo.algorithms import ARPOConfig


@pytest.fixture(scope="module")
def ray_local():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_import_registers_the_names_without_ray():
    """``import arpo_algo`` stays light (no Ray, no torch) and Tune finds the names once it loads, unstarted."""
    code = (
        "import sys, arpo_algo\n"
        "assert not any(m.split('.')[0] in ('ray', 'torch') for m in sys.modules), 'import arpo_algo loaded Ray'\n"
        "import ray\n"
        "from ray.tune.registry import get_trainable_cls\n"
        "print([get_trainable_cls(n).__name__ for n in ('ARPO', 'AEPO', 'GRPO')], ray.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[-2] == "['ARPO', 'AEPO', 'GRPO'] False"


def test_the_names_outlive_a_ray_session():
    """Tune keeps a registered name only in the running cluster's store: after ``ray.shutdown()``, and after a new
    ``ray.init()`` in the same process, ARPO and a variant registered later are still found."""
    code = (
        "import ray, arpo_algo\n"
        "from ray.tune.registry import get_trainable_cls\n"
        "from arpo_algo.algorithms import ARPO, ARPOConfig, register_variant\n"
        "def names():\n"
        "    print([get_trainable_cls(n).__name__ for n in ('ARPO', 'GRPO', 'LATER')])\n"
        "ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        "class LaterConfig(ARPOConfig):\n"
        "    variant = 'later'\n"
        "class Later(ARPO):\n"
        "    pass\n"
        "register_variant(LaterConfig, Later)  # registered while a Ray session runs\n"
        "names()\n"
        "ray.shutdown()\n"
        "names()\n"
        "ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        "names()\n"
        "ray.shutdown()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-3:] == ["['ARPO', 'GRPO', 'Later']"] * 3, out.stdout


def test_params_json_holds_arpo_settings_only():
    cfg = ARPOConfig().environment("arpo/ToolMath-v0", env_config={"levels": [1]}).debugging(seed=3)
    d = cfg.to_dict()
    assert {k for k in d if "." not in k} == {"env", "env_config", "seed"}
    assert set(d) - {"env", "env_config", "seed"} == set(cfg.settings.flat())
    back = ARPOConfig().update_from_dict(d)
    assert back.seed == 3 and back.env_config == {"levels": [1]} and back.settings == cfg.settings


def test_tuner_by_name(ray_local, tiny_model_dir, tmp_path):
    """``tune.Tuner("ARPO")`` from Python, no dirname creator: one real iteration on the tiny model."""
    from ray import tune

    space = (
        ARPOConfig()
        .environment("arpo/ToolMath-v0", env_config={"levels": [1], "max_tool_calls": 1})
        .training(model_path=str(tiny_model_dir), prompts_per_step=2, lr=tune.choice([1e-4, 3e-4]))
        .tree(budget=2, initial=1)
        .llm_rollouts(max_response_tokens=12, hf={"max_batch_size": 4})
    )
    results = tune.Tuner(
        "ARPO",
        param_space=space,
        tune_config=tune.TuneConfig(num_samples=1),
        run_config=tune.RunConfig(name="s", storage_path=str(tmp_path), stop={"training_iteration": 1}, verbose=0),
    ).fit()
    assert not results.errors
    r = results[0]
    trial_dir = tmp_path / "s" / r.path.rsplit("/", 1)[-1]
    # "ARPO_arpo_ToolMa_<date>": Tune's trial name cut at 16, whatever variants the process registered before
    assert trial_dir.is_dir() and len(trial_dir.name) <= 16 + len("_2026-12-07_06-24-24"), trial_dir.name
    assert trial_dir.name.startswith("ARPO_") and "training.lr" not in trial_dir.name

    params = json.loads((trial_dir / "params.json").read_text())
    assert {k for k in params if "." not in k} <= {"env", "env_config", "seed"}
    assert params["training.lr"] in (1e-4, 3e-4) and "tree.tau" in params

    m, runners = r.metrics, r.metrics["env_runners"]
    # 2 prompts x budget 2 = 4 trajectories: the episodes; every one took at least one model turn
    assert runners["num_episodes"] == m["num_trajectories"] == 4.0
    assert runners["num_episodes_lifetime"] == m["num_episodes_lifetime"] == 4.0
    assert runners["episode_return_mean"] == pytest.approx(m["reward_mean"])
    assert runners["episode_return_max"] == pytest.approx(m["reward_max"])
    steps = runners["num_env_steps_sampled"]
    assert 4 <= steps <= 4 * 2  # max_tool_calls = 1: one or two turns per trajectory
    assert m["num_env_steps_sampled_lifetime"] == runners["num_env_steps_sampled_lifetime"] == steps
    assert runners["episode_len_mean"] == pytest.approx(steps / 4)

    trees = trial_dir / "trees"  # in the sweep's trial folder, not in Ray's temporary working folder
    assert trees.is_dir() and any(trees.iterdir())
