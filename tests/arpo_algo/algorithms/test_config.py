"""ARPOConfig strictness: unknown keys (setters, update_from_dict/from_dict, TOML), wrong types, illegal combos."""

from __future__ import annotations

from pathlib import Path

import pytest

from arpo_algo.algorithms import AEPOConfig, ARPOConfig, GRPOConfig
from arpo_algo.run.experiment import EXPERIMENTS_DIR, load_experiment, resolve_experiment_path
from arpo_base.errors import ConfigError


def valid_config(cls: type[ARPOConfig] = ARPOConfig) -> ARPOConfig:
    return cls().environment("arpo/ToolMath-v0").training(model_path="/nonexistent/model")


# ------------------------------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("setter, key, suggestion", [
    ("tree", "bugdet", "budget"),
    ("training", "clip_hihg", "clip_high"),
    ("llm_rollouts", "num_rollout_actor", "num_rollout_actors"),
    ("evaluation", "eval_sample", "eval_samples"),
])
def test_unknown_key_in_setter_names_it_and_suggests(setter, key, suggestion):
    with pytest.raises(ConfigError) as err:
        getattr(ARPOConfig(), setter)(**{key: 1})
    assert repr(key) in err.value.message
    assert suggestion in err.value.hint


def test_rllib_training_args_without_effect_are_rejected():
    with pytest.raises(ConfigError, match="gamma"):
        ARPOConfig().training(gamma=0.9)


def test_update_from_dict_rejects_unknown_keys_tune_path():
    with pytest.raises(ConfigError) as err:
        ARPOConfig().update_from_dict({"entropy_weigth": 0.3})
    assert "entropy_weigth" in err.value.message
    with pytest.raises(ConfigError, match="budgte"):
        ARPOConfig.from_dict({"budgte": 4})


def test_update_from_dict_accepts_its_own_to_dict_and_tune_keys():
    src = valid_config().tree(budget=6, initial=3).training(lr=3e-5)
    d = src.to_dict()
    d.update({"__trial_info__": None, "__stdout_file__": None, "__stderr_file__": None})
    cfg = ARPOConfig().update_from_dict(d)
    assert (cfg.budget, cfg.initial, cfg.lr) == (6, 3, 3e-5)
    assert cfg.tree_config().budget == 6 and cfg.learner_config().lr == 3e-5


# ------------------------------------------------------------------------------------------------------ types


@pytest.mark.parametrize("setter, kwargs", [
    ("tree", {"budget": 2.5}),
    ("tree", {"budget": True}),
    ("training", {"lr": "fast"}),
    ("training", {"dedup_prefix": 1}),
    ("llm_rollouts", {"device": "tpu"}),
    ("llm_rollouts", {"engine": "sglang"}),
    ("llm_rollouts", {"decode": "graphs"}),
    ("evaluation", {"eval_num_prompts": "all"}),
])
def test_wrong_types_are_rejected(setter, kwargs):
    key = next(iter(kwargs))
    with pytest.raises(ConfigError, match=key):
        getattr(ARPOConfig(), setter)(**kwargs)


def test_wrong_type_through_dict_path_is_rejected():
    with pytest.raises(ConfigError, match="budget"):
        ARPOConfig().update_from_dict({"budget": "eight"})


def test_int_is_accepted_for_float_fields():
    cfg = ARPOConfig().tree(alpha=1).training(lr=1)
    assert isinstance(cfg.alpha, float) and isinstance(cfg.lr, float)


def test_search_space_is_allowed_in_setters_but_not_at_validate():
    from ray import tune

    cfg = valid_config().tree(beta=tune.uniform(0.0, 1.0))
    with pytest.raises(ConfigError, match="search space"):
        cfg.validate()


# ----------------------------------------------------------------------------------------------- combinations


@pytest.mark.parametrize("mutate, match", [
    (lambda c: c.training(model_path=None), "model_path"),
    (lambda c: c.environment(env=None), "environment"),
    (lambda c: c.llm_rollouts(temperature=0.0), "temperature"),
    (lambda c: c.evaluation(eval_samples=4), "greedy"),
    (lambda c: c.tree(initial=9, budget=8), "initial"),                 # TreeConfig.validate
    (lambda c: c.training(clip_c=0.5), "clip_c"),                       # LearnerConfig.validate
    (lambda c: c.llm_rollouts(dtype="bfloat16"), "float32"),            # in-process engine shares the module
    (lambda c: c.llm_rollouts(num_rollout_actors=-1), "num_rollout_actors"),
    (lambda c: c.tree(aepo_premonitor_keep=True), "aepo"),              # AEPO knob on ARPO
    (lambda c: c.llm_rollouts(engine="vllm"), "topk_sum_lnV"),          # vLLM has no full entropy
    (lambda c: c.llm_rollouts(decode="cuda_graph"), "needs device='cuda'"),  # no silent fallback on CPU
    (lambda c: c.llm_rollouts(decode="cuda_graph", device="cuda", linear_layout="transposed"), "transposed"),
    (lambda c: c.llm_rollouts(decode="static", engine="vllm").tree(entropy_method="topk_sum_lnV"), "engine='hf'"),
    (lambda c: c.llm_rollouts(decode="static", static_cache_tokens=1), "static_cache_tokens"),
])
def test_illegal_combinations_are_explained(mutate, match):
    cfg = mutate(valid_config())
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_valid_config_validates():
    valid_config().validate()
    # vLLM holds its own weights, so it may run in bfloat16 in-process
    valid_config().llm_rollouts(engine="vllm", dtype="bfloat16").tree(entropy_method="topk_sum_lnV").validate()


def test_variants_share_one_path_with_their_defaults():
    arpo, aepo, grpo = valid_config(), valid_config(AEPOConfig), valid_config(GRPOConfig)
    for cfg in (arpo, aepo, grpo):
        cfg.validate()
    assert arpo.tree_config().mode == "arpo" and arpo.tree_config().branch_factor >= 1
    assert aepo.tree_config().mode == "aepo" and aepo.aepo_penalty == 0.05
    assert aepo.learner_config().entropy_balanced_clip
    # the docstring and the released scripts: pre-monitoring off by default, on by name (issue 10)
    assert not aepo.tree_config().premonitor_on and "pre-monitoring off" in AEPOConfig.__doc__
    assert valid_config(AEPOConfig).tree(aepo_premonitor=True).tree_config().premonitor_on
    g = grpo.tree_config()
    assert g.mode == "grpo" and g.branch_factor == 0 and g.initial == g.budget
    with pytest.raises(ConfigError, match="grpo"):
        valid_config(GRPOConfig).tree(budget=16).validate()  # initial must follow budget explicitly


def test_new_fields_avoid_reserved_rllib_names():
    cfg = ARPOConfig()
    for reserved in ("num_rollout_workers", "rollouts"):
        assert reserved not in cfg.arpo_settings()["llm_rollouts"]


# -------------------------------------------------------------------------------------------------------- TOML


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.toml"
    p.write_text(text)
    return p


BASE = '[model]\npath = "m"\n[env]\nid = "arpo/ToolMath-v0"\n'


def test_toml_unknown_section_and_key_name_the_file(tmp_path):
    p = write(tmp_path, BASE + "[trees]\nbudget = 4\n")
    with pytest.raises(ConfigError) as err:
        load_experiment(p)
    assert str(p) in err.value.message and "trees" in err.value.message and "tree" in err.value.hint
    p = write(tmp_path, BASE + "[tree]\nbudgte = 4\n")
    with pytest.raises(ConfigError) as err:
        load_experiment(p)
    assert str(p) in err.value.message and "budget" in err.value.hint
    with pytest.raises(ConfigError, match="max_tool_call"):  # [env] keys are checked by the env's own config
        load_experiment(write(tmp_path, BASE.replace("[env]", "[env]\nmax_tool_call = 3")))


def test_toml_wrong_types_and_missing_sections(tmp_path):
    with pytest.raises(ConfigError, match="budget"):
        load_experiment(write(tmp_path, BASE + '[tree]\nbudget = "8"\n'))
    with pytest.raises(ConfigError, match="iterations"):
        load_experiment(write(tmp_path, BASE + "[experiment]\niterations = 2.5\n"))
    with pytest.raises(ConfigError, match=r"\[model\] path"):
        load_experiment(write(tmp_path, '[env]\nid = "arpo/ToolMath-v0"\n'))


def test_toml_maps_every_section_and_overrides(tmp_path):
    p = write(tmp_path, BASE + """
[experiment]
algorithm = "aepo"
seed = 7
[tree]
budget = 6
[training]
lr = 2e-5
[rollouts]
max_response_tokens = 99
[evaluation]
every = 3
num_prompts = 5
""")
    exp = load_experiment(p, ["tree.initial=2", "env.max_tool_calls=2", "evaluation.temperature=0.5"])
    c = exp.config
    assert isinstance(c, AEPOConfig) and c.seed == 7 and c.model_path == "m"
    assert (c.budget, c.initial, c.lr, c.max_response_tokens) == (6, 2, 2e-5, 99)
    assert (c.evaluation_interval, c.eval_num_prompts, c.eval_temperature) == (3, 5, 0.5)
    assert c.env == "arpo/ToolMath-v0" and c.env_config == {"max_tool_calls": 2}


def test_overrides_read_toml_literals_and_name_the_closest_section(tmp_path):
    exp = load_experiment(write(tmp_path, BASE), ["tree.budget=6", "env.levels=[1, 2]", "model.path=/a/b"])
    assert exp.config.budget == 6 and exp.config.env_config["levels"] == [1, 2] and exp.config.model_path == "/a/b"
    with pytest.raises(ConfigError, match="the key must be section.key"):
        load_experiment(write(tmp_path, BASE), ["budget=8"])
    with pytest.raises(ConfigError, match="unknown section 'rollout'") as err:
        load_experiment(write(tmp_path, BASE), ["rollout.temperature=0.5"])
    assert err.value.hint == "did you mean 'rollouts'?"


def test_a_replaced_key_names_its_replacement(tmp_path):
    """training.bf16 became training.precision: the error says so instead of guessing a near name."""
    with pytest.raises(ConfigError, match="unknown key 'bf16'") as err:
        load_experiment(write(tmp_path, BASE), ["training.bf16=true"])
    assert 'precision = "bf16"' in err.value.hint


def test_total_steps_is_derived_from_the_iterations(tmp_path):
    """Bug: total_steps stayed 1 whatever the run's length, so a decaying schedule hit lr 0 after one update."""
    exp = load_experiment(write(tmp_path, BASE + '[experiment]\niterations = 7\n[training]\nlr_schedule = "cosine"\n'
                                "ppo_epochs = 2\n"))
    assert exp.config.total_steps == 14 and exp.config.learner_config().total_steps == 14
    exp.config.validate()
    exp = load_experiment(write(tmp_path, BASE + "[training]\ntotal_steps = 100\n"))  # an explicit value wins
    assert exp.config.total_steps == 100
    with pytest.raises(ConfigError, match="decays to 0 at total_steps, which is not set"):
        valid_config(ARPOConfig).training(lr_schedule="cosine").validate()  # no run length known: refuse


def test_experiments_are_found_outside_the_checkout(tmp_path, monkeypatch):
    """A wheel install has no checkout: names are looked up in $ARPO_EXPERIMENTS and ./experiments too."""
    import arpo_algo.run.experiment as experiment
    from arpo_base.errors import ArpoError

    monkeypatch.setattr(experiment, "EXPERIMENTS_DIR", None)  # as in a wheel install
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArpoError, match="not found: neither a file nor <name>.toml in") as err:
        resolve_experiment_path("mine")
    assert "ARPO_EXPERIMENTS" in err.value.hint
    (tmp_path / "elsewhere").mkdir()
    write(tmp_path / "elsewhere", BASE).rename(tmp_path / "elsewhere" / "mine.toml")
    monkeypatch.setenv("ARPO_EXPERIMENTS", str(tmp_path / "elsewhere"))
    assert resolve_experiment_path("mine") == tmp_path / "elsewhere" / "mine.toml"
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "local.toml").write_text(BASE)
    assert load_experiment("local").run.name == "local"
    with pytest.raises(ArpoError) as err:
        resolve_experiment_path("nope")
    assert err.value.hint == "known experiments: local, mine"


@pytest.mark.parametrize("path", sorted(p for p in EXPERIMENTS_DIR.glob("*.toml") if "[sweep]" not in p.read_text()),
                         ids=lambda p: p.stem)  # sweep files (tune_*.toml) are checked by the sweep tests
def test_shipped_experiments_load_and_validate(path):
    exp = load_experiment(path)
    exp.config.validate()
