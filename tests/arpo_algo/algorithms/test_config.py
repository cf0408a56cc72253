"""ARPOConfig: one dotted name per setting on every path (setters, dicts, TOML, --set), strict keys and types,
moved keys that name their new place, illegal combinations explained."""

from __future__ import annotations

from pathlib import Path

import pytest

from arpo_algo.algorithms import AEPOConfig, ARPOConfig, GRPOConfig
from arpo_algo.run.experiment import (
    EXPERIMENTS_DIR,
    PACKAGE_EXPERIMENTS_DIR,
    load_experiment,
    resolve_experiment_path,
)
from arpo_base.errors import ConfigError


def valid_config(cls: type[ARPOConfig] = ARPOConfig) -> ARPOConfig:
    return cls().environment("arpo/ToolMath-v0").training(model_path="/nonexistent/model")


# ------------------------------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    "setter, key, suggestion",
    [
        ("tree", "bugdet", "budget"),
        ("training", "clip_hihg", "clip_high"),
        ("llm_rollouts", "num_rollout_actor", "num_rollout_actors"),
        ("evaluation", "sample", "samples"),
        ("backend", "learner_worker", "learner_workers"),
    ],
)
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
    assert (d["tree.budget"], d["tree.initial"], d["training.lr"]) == (6, 3, 3e-5)  # the dotted names, as --set
    cfg = ARPOConfig().update_from_dict(d)
    assert cfg.settings == src.settings
    assert (cfg.settings.tree.budget, cfg.settings.tree.initial, cfg.settings.training.lr) == (6, 3, 3e-5)


def test_one_dotted_name_per_setting_on_every_path(tmp_path):
    """A setting is addressed by the same name by a setter, a dict (Tune), --set and an experiment file."""
    by_setter = valid_config().llm_rollouts(hf={"decode": "static"}).tree(tau=0.3)
    by_name = valid_config().update_settings({"rollouts.hf.decode": "static", "tree.tau": 0.3})
    by_dict = valid_config().update_from_dict({"rollouts.hf.decode": "static", "tree.tau": 0.3})
    by_set = load_experiment(write(tmp_path, BASE), ["rollouts.hf.decode=static", "tree.tau=0.3"]).config
    by_file = load_experiment(write(tmp_path, BASE + '[tree]\ntau = 0.3\n[rollouts.hf]\ndecode = "static"\n')).config
    for cfg in (by_name, by_dict, by_set, by_file):
        assert cfg.settings.rollouts.hf.decode == "static" and cfg.settings.tree.tau == 0.3
    assert by_setter.settings.rollouts == by_file.settings.rollouts and by_setter.settings.tree == by_file.settings.tree
    assert set(ARPOConfig().settings.flat()) <= set(ARPOConfig().to_dict())


@pytest.mark.parametrize("key", ["tau", "eval_split", "decode", "learner_backend"])
def test_a_flat_name_in_a_dict_is_an_unknown_key(key):
    """Settings have one name each, the dotted one: a bare name is an unknown key like any other."""
    with pytest.raises(ConfigError, match=f"unknown key {key!r}") as err:
        ARPOConfig().update_from_dict({key: 1})
    assert err.value.hint


@pytest.mark.parametrize("key, ours", [("lr", "training.lr"), ("evaluation_interval", "evaluation.every")])
def test_an_rllib_setting_that_arpo_replaces_names_arpos_setting(key, ours):
    with pytest.raises(ConfigError) as err:
        ARPOConfig().update_from_dict({key: 1})
    assert repr(ours) in err.value.message


def test_a_key_in_the_wrong_section_is_an_unknown_key(tmp_path):
    """No key is an alias of another place: a key under the wrong section fails as unknown, naming the section."""
    with pytest.raises(ConfigError, match=r"\[rollouts\]: unknown key 'max_batch_size'"):
        load_experiment(write(tmp_path, BASE + "[rollouts]\nmax_batch_size = 8\n"))
    with pytest.raises(ConfigError, match=r"\[training\]: unknown key 'learner_backend'"):
        load_experiment(write(tmp_path, BASE), ["training.learner_backend=ddp"])
    with pytest.raises(ConfigError, match=r"\[rollouts.hf\]: unknown key 'decod'"):
        load_experiment(write(tmp_path, BASE), ["rollouts.hf.decod=static"])


def test_every_engine_setting_is_reachable_from_a_file(tmp_path):
    """The vLLM engine's own settings come from [rollouts.vllm] and reach the engine's keyword arguments."""
    from arpo_algo.rollout.engines.config import VLLMEngineConfig

    exp = load_experiment(
        write(
            tmp_path,
            BASE
            + """
[tree]
entropy_method = "topk_sum_lnV"
[rollouts]
engine = "vllm"
[rollouts.vllm]
gpu_memory_utilization = 0.3
tensor_parallel_size = 2
max_model_len = 4096
enforce_eager = true
""",
        )
    )
    exp.config.validate()
    kwargs = exp.config.settings.rollouts.engine_config.engine_kwargs()
    assert (kwargs["gpu_memory_utilization"], kwargs["tensor_parallel_size"]) == (0.3, 2)
    assert (kwargs["max_model_len"], kwargs["enforce_eager"]) == (4096, True)
    import inspect

    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

    params = inspect.signature(VLLMEngine).parameters
    assert set(kwargs) <= set(params), "every [rollouts.vllm] key is a VLLMEngine argument"
    assert all(params[k].default == v for k, v in VLLMEngineConfig().engine_kwargs().items())  # same defaults


# ------------------------------------------------------------------------------------------------------ types


@pytest.mark.parametrize(
    "setter, kwargs",
    [
        ("tree", {"budget": 2.5}),
        ("tree", {"budget": True}),
        ("training", {"lr": "fast"}),
        ("training", {"dedup_prefix": 1}),
        ("llm_rollouts", {"device": "tpu"}),
        ("llm_rollouts", {"engine": "sglang"}),
        ("llm_rollouts", {"hf": {"decode": "graphs"}}),
        ("evaluation", {"num_prompts": "all"}),
    ],
)
def test_wrong_types_are_rejected(setter, kwargs):
    key = next(iter(kwargs)) if "hf" not in kwargs else "decode"
    with pytest.raises(ConfigError, match=key):
        getattr(ARPOConfig(), setter)(**kwargs)


def test_wrong_type_through_dict_path_is_rejected():
    with pytest.raises(ConfigError, match="budget"):
        ARPOConfig().update_from_dict({"tree.budget": "eight"})


def test_int_is_accepted_for_float_fields():
    cfg = ARPOConfig().tree(alpha=1).training(lr=1)
    assert isinstance(cfg.settings.tree.alpha, float) and isinstance(cfg.settings.training.lr, float)


def test_search_space_is_allowed_in_setters_but_not_at_validate():
    from ray import tune

    cfg = valid_config().tree(beta=tune.uniform(0.0, 1.0))
    with pytest.raises(ConfigError, match="search space"):
        cfg.validate()


# ----------------------------------------------------------------------------------------------- combinations


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda c: c.training(model_path=None), "model.path"),
        (lambda c: c.environment(env=None), "environment"),
        (lambda c: c.llm_rollouts(temperature=0.0), "temperature"),
        (lambda c: c.evaluation(samples=4), "greedy"),
        (lambda c: c.tree(initial=9, budget=8), "initial"),  # TreeConfig.validate
        (lambda c: c.training(clip_c=0.5), "clip_c"),  # LearnerConfig.validate
        (lambda c: c.llm_rollouts(dtype="bfloat16"), "shares the learner's float32 module"),  # local learner's module
        (lambda c: c.llm_rollouts(num_rollout_actors=-1), "num_rollout_actors"),
        (lambda c: c.tree(aepo_premonitor_keep=True), "aepo"),  # AEPO knob on ARPO
        (lambda c: c.llm_rollouts(engine="vllm"), "topk_sum_lnV"),  # vLLM has no full entropy
        (
            lambda c: c.llm_rollouts(engine="vllm").tree(entropy_method="topk_sum_lnV", topk_logprobs=65),
            r"tree.topk_logprobs=65 .* at most 64 logprobs",
        ),  # vLLM's max_logprobs, before it starts
        (
            lambda c: c.llm_rollouts(hf={"decode": "cuda_graph"}),
            "needs rollouts.device='cuda'",
        ),  # no silent CPU fallback
        (
            lambda c: c.llm_rollouts(device="cuda", hf={"decode": "cuda_graph", "linear_layout": "transposed"}),
            "transposed",
        ),
        (
            lambda c: c.llm_rollouts(engine="vllm", hf={"decode": "static"}).tree(entropy_method="topk_sum_lnV"),
            "engine = 'hf' only",
        ),
        (lambda c: c.llm_rollouts(hf={"decode": "static", "static_cache_tokens": 1}), "static_cache_tokens"),
        (lambda c: c.evaluation(every=-1), "evaluation.every"),
        (lambda c: c.llm_rollouts(top_k=0), "top_k=0: -1 is the value that means off"),  # engines refuse 0 per request
        (lambda c: c.llm_rollouts(top_k=-2), "top_k=-2: -1 is the value"),
        (lambda c: c.training(prompts_per_step=0), "prompts_per_step"),
        # asynchronous rollouts: each combination whose invariant the pipeline cannot keep
        (lambda c: c.llm_rollouts(asynchronous=True), "needs rollout actors"),
        (lambda c: c.llm_rollouts(asynchronous=True, num_rollout_actors=1, max_staleness=2), "must be 0 or 1"),
        (lambda c: c.llm_rollouts(max_staleness=-1), "must be 0 or 1"),
        (
            lambda c: c.llm_rollouts(asynchronous=True, num_rollout_actors=1).training(dynamic_sampling=True),
            "next batch's prompts are not known",
        ),
        (
            lambda c: c.llm_rollouts(asynchronous=True, num_rollout_actors=1).backend(learner_backend="ddp"),
            "only the local learner",
        ),
    ],
)
def test_illegal_combinations_are_explained(mutate, match):
    cfg = mutate(valid_config())
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_valid_config_validates():
    valid_config().validate()
    valid_config().llm_rollouts(asynchronous=True, num_rollout_actors=1).validate()
    valid_config().llm_rollouts(asynchronous=True, num_rollout_actors=1, max_staleness=0).training(
        old_logprobs="recompute"
    ).validate()  # recomputed under the sampling version's weights
    # vLLM holds its own weights, so it may run in bfloat16 in-process
    valid_config().llm_rollouts(engine="vllm", dtype="bfloat16").tree(entropy_method="topk_sum_lnV").validate()
    valid_config().llm_rollouts(engine="vllm").tree(entropy_method="topk_sum_lnV", topk_logprobs=64).validate()
    # the in-process HF engine holds its own copy with a ddp/deepspeed learner or with actors, so bfloat16 is allowed
    valid_config().llm_rollouts(dtype="bfloat16").backend(learner_backend="ddp", learner_workers=2).validate()
    valid_config().llm_rollouts(dtype="bfloat16", num_rollout_actors=1).validate()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda c: c.training(entropy_balanced_clip=True), "entropy_balanced_clip = true would do nothing"),
        (lambda c: c.training(clip_high=0.28), r"clip_high = 0.28 \(clip-higher"),
        (lambda c: c.training(clip_c=5.0), "clip_c = 5.0 .the dual clip's bound"),
        # asynchronous but never stale: the ratio is 1 all the same
        (
            lambda c: c.training(entropy_balanced_clip=True).llm_rollouts(
                asynchronous=True, num_rollout_actors=1, max_staleness=0
            ),
            "ratio is exactly 1",
        ),
    ],
)
def test_options_that_act_only_through_the_ratio_are_refused_where_it_is_1(mutate, match):
    with pytest.raises(ConfigError, match=match) as err:
        mutate(valid_config()).validate()
    assert "training.mini_batches = 4" in err.value.hint  # min(8, prompts_per_step) with 4 prompts per step
    with pytest.raises(ConfigError, match="training.mini_batches = 2"):
        mutate(valid_config()).training(prompts_per_step=2).validate()


def test_options_that_act_only_through_the_ratio_are_kept_where_it_moves():
    clip = valid_config().training(entropy_balanced_clip=True, clip_high=0.28, clip_c=5.0)
    clip.training(mini_batches=2).validate()  # the second step's ratio moves
    clip.training(ppo_epochs=2).validate()
    clip.training(old_logprobs="rollout").validate()  # the sampler's log-probs: not the learner's
    clip.llm_rollouts(asynchronous=True, num_rollout_actors=1).validate()  # a batch one version behind
    valid_config(AEPOConfig).validate()  # AEPO's defaults take several steps
    with pytest.raises(ConfigError, match="entropy_balanced_clip"):
        valid_config(AEPOConfig).training(mini_batches=1).validate()
    assert valid_config(AEPOConfig).settings.training.mini_batch_count == 4


@pytest.mark.parametrize("prompts, steps", [(1, 1), (2, 2), (4, 4), (16, 8)])
def test_aepo_takes_min_8_prompts_mini_batches_from_its_own_prompts_per_step(prompts, steps):
    """Bug: AEPO's default was a fixed 4 mini-batches, so AEPO with fewer than 4 prompts per step was refused for a
    value the user never set, and with more than 8 it took 4 steps instead of 8."""
    config = valid_config(AEPOConfig).training(prompts_per_step=prompts)
    if prompts == 1:  # one group: one step, so the clip cannot act and AEPO's clip is refused, naming the cause
        with pytest.raises(ConfigError, match="entropy_balanced_clip"):
            config.validate()
        return
    config.validate()
    assert config.settings.training.mini_batch_count == steps


def test_a_sweep_over_prompts_per_step_keeps_aepo_mini_batches_derived(tmp_path):
    """Through Tune's dict path (the base config's dict with a trial's point written over it), AEPO's unset
    mini-batches follow the trial's prompts per step instead of the base's."""
    trial = valid_config(AEPOConfig).to_dict()
    trial.update({"training.prompts_per_step": 2})
    config = AEPOConfig().update_from_dict(trial)
    config.validate()
    assert config.settings.training.mini_batch_count == 2


def test_variants_share_one_path_with_their_defaults():
    arpo, aepo, grpo = valid_config(), valid_config(AEPOConfig), valid_config(GRPOConfig)
    for cfg in (arpo, aepo, grpo):
        cfg.validate()
    assert arpo.settings.tree.mode == "arpo" and arpo.settings.tree.branch_factor >= 1
    assert aepo.settings.tree.mode == "aepo" and aepo.settings.tree.aepo_penalty == 0.05
    assert aepo.settings.training.entropy_balanced_clip
    # the docstring and the released scripts: pre-monitoring off by default, on by name
    assert not aepo.settings.tree.premonitor_on and "pre-monitoring off" in AEPOConfig.__doc__
    assert valid_config(AEPOConfig).tree(aepo_premonitor=True).settings.tree.premonitor_on
    with pytest.raises(ConfigError, match="tree.mode is the algorithm"):
        ARPOConfig().update_settings({"tree.mode": "grpo"})
    g = grpo.settings.tree
    assert g.mode == "grpo" and g.branch_factor == 0 and g.initial == g.budget
    with pytest.raises(ConfigError, match="grpo"):
        valid_config(GRPOConfig).tree(budget=16).validate()  # initial must follow budget explicitly


def test_settings_do_not_shadow_rllib_attributes():
    """Every ARPO setting lives in config.settings: none may replace an RLlib attribute or method silently."""
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    rllib = set(vars(AlgorithmConfig())) | set(dir(AlgorithmConfig))
    assert "settings" not in rllib and "update_settings" not in rllib and "backend" not in rllib
    assert set(vars(ARPOConfig())) - set(vars(AlgorithmConfig())) == {"settings"}


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
    p = write(
        tmp_path,
        BASE
        + """
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
""",
    )
    exp = load_experiment(p, ["tree.initial=2", "env.max_tool_calls=2", "evaluation.temperature=0.5"])
    c = exp.config
    s = c.settings
    assert isinstance(c, AEPOConfig) and c.seed == 7 and s.model.path == "m"
    assert (s.tree.budget, s.tree.initial, s.training.lr, s.rollouts.max_response_tokens) == (6, 2, 2e-5, 99)
    assert (s.evaluation.every, s.evaluation.num_prompts, s.evaluation.temperature) == (3, 5, 0.5)
    assert c.evaluation_interval == 3  # RLlib schedules evaluation from it
    assert c.env == "arpo/ToolMath-v0" and c.env_config == {"max_tool_calls": 2}


def test_overrides_read_toml_literals_and_name_the_closest_section(tmp_path):
    exp = load_experiment(write(tmp_path, BASE), ["tree.budget=6", "env.levels=[1, 2]", "model.path=/a/b"])
    assert exp.config.settings.tree.budget == 6 and exp.config.env_config["levels"] == [1, 2]
    assert exp.config.settings.model.path == "/a/b"
    with pytest.raises(ConfigError, match="the key must be section.key"):
        load_experiment(write(tmp_path, BASE), ["budget=8"])
    with pytest.raises(ConfigError, match="unknown section 'rollout'") as err:
        load_experiment(write(tmp_path, BASE), ["rollout.temperature=0.5"])
    assert err.value.hint == "did you mean 'rollouts'?"


def test_a_peft_key_gets_its_reason_only_in_model_lora(tmp_path):
    """PEFT's `bias` in [model.lora] is refused with the reason arpo does not take it; the same word in another table
    is an ordinary unknown key (before, every table's `bias` got the LoRA explanation)."""
    with pytest.raises(ConfigError, match="unknown key 'bias'") as err:
        load_experiment(write(tmp_path, BASE), ['model.lora.bias="all"'])
    assert "adapter matrices only" in err.value.hint
    with pytest.raises(ConfigError, match="unknown key 'bias'") as err:
        load_experiment(write(tmp_path, BASE), ["training.bias=true"])
    assert "lora" not in err.value.hint and "valid keys" in err.value.hint


def test_total_steps_is_derived_from_the_iterations(tmp_path):
    """Bug: total_steps stayed 1 whatever the run's length, so a decaying schedule hit lr 0 after one update."""
    exp = load_experiment(
        write(tmp_path, BASE + '[experiment]\niterations = 7\n[training]\nlr_schedule = "cosine"\nppo_epochs = 2\n')
    )
    assert exp.config.settings.training.schedule_steps == 14
    exp.config.validate()
    # The learner steps the schedule once per mini-batch: a run of 3 iterations x 2 epochs x 4 mini-batches takes 24
    # optimizer steps, and a schedule sized to 6 would reach lr 0 a quarter of the way in.
    exp = load_experiment(
        write(
            tmp_path,
            BASE + '[experiment]\niterations = 3\n[training]\nlr_schedule = "linear"\n'
            "ppo_epochs = 2\nmini_batches = 4\nprompts_per_step = 4\n",
        )
    )
    assert exp.config.settings.training.schedule_steps == 24
    exp = load_experiment(write(tmp_path, BASE + "[training]\ntotal_steps = 100\n"))  # an explicit value wins
    assert exp.config.settings.training.schedule_steps == 100
    with pytest.raises(ConfigError, match="decays to 0 at total_steps, which is not set"):
        valid_config(ARPOConfig).training(lr_schedule="cosine").validate()  # no run length known: refuse


def test_a_sweep_trial_keeps_a_schedule_that_ends_at_its_own_last_step(tmp_path):
    """Bug: the base experiment's step count went into every trial's config dict, so a trial with more mini-batches
    (or epochs) than the base reached lr 0 early. Each trial now spans its own iterations x epochs x mini-batches."""
    exp = load_experiment(
        write(
            tmp_path, BASE + '[experiment]\niterations = 5\n[training]\nlr_schedule = "cosine"\nprompts_per_step = 4\n'
        )
    )
    trial = exp.config.to_dict()
    trial.update({"training.mini_batches": 4, "training.ppo_epochs": 2})  # what a Tune point writes over the base
    config = type(exp.config)().update_from_dict(trial)
    assert config.settings.training.schedule_steps == 5 * 2 * 4


def test_experiments_are_found_outside_the_checkout(tmp_path, monkeypatch):
    """A wheel install has no checkout: names are looked up in $ARPO_EXPERIMENTS and ./experiments too."""
    import arpo_algo.run.experiment as experiment
    from arpo_base.errors import ArpoError

    monkeypatch.setattr(experiment, "EXPERIMENTS_DIR", None)  # as in a wheel install
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArpoError, match="not found: neither a file nor <name>.toml under") as err:
        resolve_experiment_path("mine")
    assert "ARPO_EXPERIMENTS" in err.value.hint and "known experiments: quickstart;" in err.value.hint
    (tmp_path / "elsewhere").mkdir()
    write(tmp_path / "elsewhere", BASE).rename(tmp_path / "elsewhere" / "mine.toml")
    monkeypatch.setenv("ARPO_EXPERIMENTS", str(tmp_path / "elsewhere"))
    assert resolve_experiment_path("mine") == tmp_path / "elsewhere" / "mine.toml"
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "local.toml").write_text(BASE)
    assert load_experiment("local").run.name == "local"
    with pytest.raises(ArpoError) as err:
        resolve_experiment_path("nope")
    assert err.value.hint.startswith("known experiments: local, mine, quickstart;")
    assert load_experiment("quickstart").run.name == "quickstart"  # shipped with the package


def test_bare_names_are_found_in_subfolders_and_two_files_of_one_name_are_refused(tmp_path, monkeypatch):
    from arpo_base.errors import ArpoError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "experiments" / "group_a").mkdir(parents=True)
    (tmp_path / "experiments" / "group_a" / "mine.toml").write_text(BASE)
    assert resolve_experiment_path("mine").resolve() == (tmp_path / "experiments" / "group_a" / "mine.toml").resolve()
    (tmp_path / "experiments" / "group_b").mkdir()
    (tmp_path / "experiments" / "group_b" / "mine.toml").write_text(BASE)
    with pytest.raises(ArpoError, match="ambiguous") as err:
        resolve_experiment_path("mine")
    assert "group_a/mine.toml" in err.value.message and "group_b/mine.toml" in err.value.message
    assert resolve_experiment_path("toolmath_aepo").parent.name == "toolmath"  # the repository's own groups


SHIPPED = [*EXPERIMENTS_DIR.rglob("*.toml"), *PACKAGE_EXPERIMENTS_DIR.glob("*.toml")]


@pytest.mark.parametrize(
    "path", sorted(p for p in SHIPPED if "[sweep]" not in p.read_text()), ids=lambda p: p.stem
)  # sweep files (tune_*.toml) are checked by the sweep tests
def test_shipped_experiments_load_and_validate(path):
    exp = load_experiment(path)
    exp.config.validate()


def test_the_compiled_decode_is_fenced_as_experimental():
    """No results page shows the compiled step faster on its target hardware, so the settings accept it only under
    the flag whose name says experimental; the engine's own keyword stays ``decode="compiled"``."""
    from arpo_algo.rollout.engines.config import HFEngineConfig

    with pytest.raises(ConfigError, match="experimental") as e:
        valid_config().llm_rollouts(hf={"decode": "compiled"}).validate()
    assert "rollouts.hf.experimental_compiled_decode = true" in e.value.hint
    cfg = valid_config().llm_rollouts(hf={"decode": "compiled", "experimental_compiled_decode": True})
    cfg.validate()
    kwargs = cfg.settings.rollouts.engine_config.engine_kwargs()
    assert kwargs["decode"] == "compiled" and "experimental_compiled_decode" not in kwargs
    assert HFEngineConfig().engine_kwargs().keys() == kwargs.keys()
