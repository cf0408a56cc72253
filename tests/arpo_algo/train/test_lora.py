"""LoRA from end to end on the tiny model: settings refused before anything loads, adapter-only training that the
shared engine samples from, adapter checkpoints tied to their base, resume, merge export, SFT then RL."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from arpo_algo.algorithms import AEPOConfig, GRPOConfig
from arpo_algo.algorithms.settings import Settings
from arpo_algo.models.lora import ADAPTER_CONFIG, ADAPTER_MARKER, ADAPTER_WEIGHTS, LoraSettings, load_policy_model
from arpo_algo.train.learner_config import ALARM_OFF
from arpo_base.errors import ConfigError
from tests.arpo_algo.algorithms.test_algorithm import tiny_config

LORA = {"model.lora.enabled": True, "model.lora.rank": 4, "model.lora.alpha": 8.0}


def _settings(**lora):
    return Settings().update({"model.path": "unused", **{f"model.lora.{k}": v for k, v in lora.items()}})


@pytest.mark.parametrize(
    "lora, match",
    [
        ({"enabled": True, "rank": 0}, "rank must be >= 1"),
        ({"enabled": True, "alpha": -1.0}, "alpha must be > 0"),
        ({"enabled": True, "dropout": 0.1}, "dropout = 0.1 in RL"),
        ({"rank": 8}, "rank set but enabled = false"),
        ({"enabled": True, "target_modules": ["lm_head"]}, "stay frozen"),
    ],
)
def test_bad_lora_settings_are_refused_before_anything_loads(lora, match):
    with pytest.raises(ConfigError, match=match):
        _settings(**lora).validate()


@pytest.mark.parametrize("key", ["use_dora", "modules_to_save", "bias"])
def test_peft_options_arpo_does_not_train_are_refused_by_name(key):
    with pytest.raises(ConfigError, match=f"unknown key '{key}'") as e:
        _settings(**{key: True})
    assert "not supported" in e.value.hint


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"backend.learner_backend": "deepspeed"}, "learner_backend = 'deepspeed'"),
        ({"rollouts.hf.decode": "static"}, "decode = 'static'"),
    ],
)
def test_paths_that_would_not_apply_the_adapter_are_refused(extra, match):
    s = Settings().update({"model.path": "unused", **LORA, **extra})
    with pytest.raises(ConfigError, match=match):
        s.validate()


VLLM = {"rollouts.engine": "vllm", "tree.entropy_method": "topk_sum_lnV"}


@pytest.mark.parametrize("rank", [0, 513, 4096])
def test_a_rank_vllm_cannot_serve_is_refused_naming_the_ones_it_can(rank):
    s = Settings().update({"model.path": "unused", **LORA, "model.lora.rank": rank, **VLLM})
    with pytest.raises(ConfigError, match=f"LoRA rank {rank} cannot be served by the vLLM engine") as e:
        s.validate()
    assert "1, 8, 16, 32, 64, 128, 256, 320, 512" in str(e.value) and "between 1 and 512" in e.value.hint


@pytest.mark.parametrize("lora", [LORA, {}], ids=["lora", "full_weights"])
def test_an_adapter_folder_as_the_vllm_engines_model_is_refused_before_anything_loads(tmp_path, lora):
    (tmp_path / "adapter_config.json").write_text("{}")
    s = Settings().update({"model.path": str(tmp_path), **lora, **VLLM})
    with pytest.raises(ConfigError, match="is a LoRA adapter folder, which the vLLM engine cannot load") as e:
        s.validate()
    assert "arpo export --merge" in e.value.hint
    Settings().update({"model.path": str(tmp_path), **lora}).validate()  # the HF engine merges it


@pytest.mark.parametrize("rank, engine_rank", [(1, 1), (2, 8), (16, 16), (17, 32), (300, 320), (512, 512)])
def test_lora_trains_on_vllm_with_the_smallest_max_lora_rank_that_holds_the_rank(rank, engine_rank):
    from arpo_algo.rollout.engines.config import vllm_lora_rank

    Settings().update({"model.path": "unused", **LORA, "model.lora.rank": rank, **VLLM}).validate()
    assert vllm_lora_rank(rank) == engine_rank


def test_the_fixed_shape_decoders_refuse_a_model_with_an_adapter(tiny_model_dir):
    from arpo_algo.models.lora import attach_adapter
    from arpo_algo.rollout.engines.hf.decode_mode import static_problem

    model = load_policy_model(tiny_model_dir, dtype=torch.float32)
    assert static_problem(model, "native", graphs=False) is None
    attach_adapter(model, LoraSettings(enabled=True, rank=2), ("q_proj",))
    assert "LoRA" in static_problem(model, "native", graphs=False)


def test_unknown_target_module_names_the_ones_that_exist(tiny_model_dir):
    from arpo_algo.train.learner import Learner, LearnerConfig

    with pytest.raises(ConfigError, match=r"\['qproj'\] are not linear layers") as e:
        Learner(tiny_model_dir, LearnerConfig(), lora=LoraSettings(enabled=True, target_modules=("qproj",)))
    assert "q_proj" in e.value.hint and "down_proj" in e.value.hint


def test_a_learner_built_directly_refuses_lora_dropout_as_the_settings_path_does(tiny_model_dir):
    from arpo_algo.train.learner import Learner, LearnerConfig

    with pytest.raises(ConfigError, match=r"dropout = 0.1 in RL") as e:
        Learner(tiny_model_dir, LearnerConfig(), lora=LoraSettings(enabled=True, dropout=0.1))
    assert "SFT may use it" in e.value.hint


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """Two LoRA ARPO iterations with the in-process engine sharing the learner's module, then a checkpoint."""
    cfg = tiny_config(tiny_model_dir).training(entropy_coef=0.01, lr=1e-2).update_settings(LORA)
    algo = cfg.build_algo()
    model = algo.learner.model
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    try:
        results = [algo.train() for _ in range(2)]
        ckpt = algo.save_to_path(str(tmp_path_factory.mktemp("lora") / "ckpt"))
        adapter = {k: v.detach().clone() for k, v in algo.learner.trainable_state().items()}
        yield {"cfg": cfg, "algo": algo, "results": results, "frozen": frozen, "ckpt": ckpt, "adapter": adapter}
    finally:
        algo.stop()


def test_only_the_adapter_trains_and_the_engine_samples_from_it(lora_run):
    algo, model = lora_run["algo"], lora_run["algo"].learner.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = {id(p) for g in algo.learner.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}  # no optimizer state for the base
    assert all(torch.equal(model.get_parameter(n), v) for n, v in lora_run["frozen"].items())  # base untouched
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert algo.engine.model is model  # unmerged adapters in the one shared module: nothing to sync
    for r in lora_run["results"]:
        assert r["learner"]["param_change_norm"] > 0
        assert r["learner"]["kl_rollout"] < 1e-4, r["learner"]["kl_rollout"]


def test_a_checkpoint_holds_the_adapter_and_its_base_fingerprint(lora_run, tiny_model_dir):
    policy = lora_run["ckpt"] + "/policy"
    import os

    names = set(os.listdir(policy))
    assert {ADAPTER_WEIGHTS, ADAPTER_CONFIG, ADAPTER_MARKER} <= names
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in names)  # no full weights
    marker = json.loads(open(f"{policy}/{ADAPTER_MARKER}").read())
    assert marker["base"] == str(tiny_model_dir.resolve()) and len(marker["fingerprint"]) == 64


def test_a_lora_policy_loads_offline_with_peft_auto_class_and_carries_its_card(lora_run, tiny_model_dir):
    """PEFT's Auto classes pick the model class from ``task_type`` (null was refused); ``base_model_name_or_path``
    stays the local base folder PEFT reads, and the card and the policy record name the base and its fingerprint."""
    from peft import AutoPeftModelForCausalLM

    from arpo_algo.models.card import read_card

    policy = lora_run["ckpt"] + "/policy"
    config = json.loads(open(f"{policy}/{ADAPTER_CONFIG}").read())
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    model = AutoPeftModelForCausalLM.from_pretrained(policy, local_files_only=True)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    torch.testing.assert_close(_logits(model, ids), _logits(lora_run["algo"].learner.model, ids), atol=1e-5, rtol=0)
    fingerprint = json.loads(open(f"{policy}/{ADAPTER_MARKER}").read())["fingerprint"]
    card = read_card(policy)
    assert card["library_name"] == "peft" and {"arpo", "lora", "reinforcement-learning"} <= set(card["tags"])
    assert "base_model" not in card  # a local base has no Hub id, and the Hub refuses a path there
    assert card["arpo"]["base_fingerprint"] == fingerprint and card["arpo"]["algorithm"] == "ARPO"
    assert card["arpo"]["env"] == "arpo/ToolMath-v0" and card["arpo"]["task"] == "toolmath"
    record = json.loads(open(f"{policy}/arpo_policy.json").read())["base_model"]
    assert record["fingerprint"] == fingerprint and record["path"] == str(tiny_model_dir.resolve())


def test_resume_restores_the_adapter(lora_run):
    algo = lora_run["cfg"].build_algo()
    try:
        algo.restore_from_path(lora_run["ckpt"])
        got = algo.learner.trainable_state()
        assert set(got) == set(lora_run["adapter"])
        assert all(torch.equal(got[k], v) for k, v in lora_run["adapter"].items())
        assert algo.learner.step == lora_run["algo"].learner.step
        assert algo.train()["learner"]["kl_rollout"] < 1e-4
    finally:
        algo.stop()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_eval_engine_and_merge_export_give_the_trained_policy(lora_run, tmp_path):
    from arpo_algo.cli.main import main
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    trained = _logits(lora_run["algo"].learner.model, ids)
    engine = HFEngine(lora_run["ckpt"], dtype="float32", seed=0)  # what arpo eval and arpo serve build
    try:
        assert torch.equal(_logits(engine.model, ids), trained)
    finally:
        engine.close()
    out = tmp_path / "merged"
    assert main(["export", "--merge", lora_run["ckpt"], "--output", str(out)]) == 0
    assert (out / "config.json").is_file() and not (out / ADAPTER_MARKER).exists()
    merged = load_policy_model(out, dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged, ids), trained, atol=1e-4, rtol=1e-4)
    assert main(["export", "--merge", lora_run["ckpt"], "--output", str(out)]) == 2  # never overwrites
    from arpo_algo.models.card import read_card

    card, policy_card = read_card(out), read_card(lora_run["ckpt"] + "/policy")
    assert card["library_name"] == "transformers" and "lora" not in card["tags"]
    assert card["arpo"]["base_fingerprint"] == policy_card["arpo"]["base_fingerprint"]
    assert card["arpo"]["merged_from"].endswith("policy") and "export --merge" in card["arpo"]["exported_by"]


def test_an_adapter_on_another_base_or_without_its_config_is_refused(lora_run, tiny_model_dir, tmp_path):
    from arpo_algo.models import resolve_model_path

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(lora_run["ckpt"], ckpt)
    marker = ckpt / "policy" / ADAPTER_MARKER
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps({**record, "base": str(base)}))
    resolve_model_path(ckpt)  # an identical copy of the base is the same base
    weights = next(base.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the base changed
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="not the one the adapter was trained on"):
        resolve_model_path(ckpt)
    algo = lora_run["cfg"].build_algo()
    try:
        with pytest.raises(ConfigError, match="not the one the adapter was trained on"):
            algo.restore_from_path(str(ckpt))
    finally:
        algo.stop()
    no_config = tmp_path / "no_config"
    shutil.copytree(lora_run["ckpt"] + "/policy", no_config)
    (no_config / ADAPTER_CONFIG).unlink()
    with pytest.raises(ConfigError, match=f"without {ADAPTER_CONFIG}"):
        resolve_model_path(no_config)
    no_marker = tmp_path / "no_marker"
    shutil.copytree(lora_run["ckpt"] + "/policy", no_marker)
    (no_marker / ADAPTER_MARKER).unlink()
    with pytest.raises(ConfigError, match=f"without {ADAPTER_MARKER}"):
        resolve_model_path(no_marker)


@pytest.mark.parametrize("cls", [GRPOConfig, AEPOConfig])
def test_grpo_and_aepo_train_the_adapter(tiny_model_dir, cls):
    cfg = tiny_config(tiny_model_dir, cls).training(entropy_coef=0.01, lr=1e-2)
    if cls is AEPOConfig:  # its entropy-balanced clip needs several optimizer steps per batch
        cfg = cfg.training(prompts_per_step=2, mini_batches=2)
    algo = cfg.update_settings(LORA).build_algo()
    try:
        r = algo.train()
    finally:
        algo.stop()
    assert r["learner"]["param_change_norm"] > 0 and r["learner"]["kl_rollout"] < 1e-4


def test_rl_after_lora_sft_starts_from_the_sft_policy_with_a_fresh_adapter(tiny_model_dir, tmp_path):
    from arpo_algo.train.learner import Learner, LearnerConfig
    from arpo_algo.train.sft import run_sft

    sft = run_sft(
        {
            "model": str(tiny_model_dir),
            "output_dir": str(tmp_path / "sft"),
            "num_examples": 8,
            "batch_size": 4,
            "epochs": 1,
            "lr": 1e-2,
            "max_seq_len": 512,
            "tensorboard": False,
            "progress": False,
            "lora": {"enabled": True, "rank": 4, "dropout": 0.1},
        }
    )
    folder = tmp_path / "sft"
    assert (folder / ADAPTER_WEIGHTS).is_file() and sft["steps"] >= 1
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    sft_policy = _logits(load_policy_model(folder, dtype=torch.float32).eval(), ids)
    assert not torch.allclose(sft_policy, _logits(load_policy_model(tiny_model_dir, dtype=torch.float32), ids))
    learner = Learner(folder, LearnerConfig(), lora=LoraSettings(enabled=True, rank=4))
    learner.model.eval()
    torch.testing.assert_close(_logits(learner.model, ids), sft_policy, atol=1e-5, rtol=1e-5)  # fresh adapter: B = 0
    assert all(float(p.detach().abs().max()) == 0 for n, p in learner.model.named_parameters() if ".lora_B." in n)
    learner.save_pretrained(tmp_path / "rl")
    assert json.loads((tmp_path / "rl" / ADAPTER_MARKER).read_text())["base"] == str(folder.resolve())


def test_rollout_actors_get_adapter_only_syncs_and_async_scores_under_the_old_adapter(tiny_model_dir, ray_session):
    """An HF rollout actor holds its own copy: the base plus the learner's adapter layout, filled by adapter-only
    syncs. Asynchronous rollouts one version behind score each batch under the adapter that sampled it (a
    snapshot of the adapter only): no false alarm, although every update moved the adapter."""
    cfg = (
        tiny_config(tiny_model_dir)
        .training(entropy_coef=0.01, lr=1e-2)
        .update_settings(LORA)
        .llm_rollouts(num_rollout_actors=1, num_cpus_per_rollout_actor=1, asynchronous=True, max_staleness=1)
    )
    algo = cfg.build_algo()
    try:
        weights = algo.learner.rollout_weights()
        assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    assert [r["rollout"]["staleness_max"] for r in results] == [0.0, 1.0]
    for r in results:
        assert r["learner"]["param_change_norm"] > 0 and r["learner"]["kl_rollout"] < 1e-4, r["learner"]


def test_ddp_trains_the_same_adapter_as_one_process(tiny_model_dir, ray_session):
    """Two gloo ranks, each with the base and an adapter made from the same seed: the summed adapter gradients give
    the single-process step (up to summation order), the replicas stay identical and the base stays frozen."""
    from transformers import AutoTokenizer

    from arpo_algo.train.backend_config import BackendConfig
    from arpo_algo.train.backends import build_backend
    from arpo_algo.train.learner import LearnerConfig
    from tests.arpo_algo.train.test_tree_forward import make_groups

    groups = make_groups(AutoTokenizer.from_pretrained(tiny_model_dir))
    cfg = LearnerConfig(lr=1e-2, grad_clip=0.5, micro_batch_tokens=64, **ALARM_OFF)
    lora = LoraSettings(enabled=True, rank=4, alpha=8.0)
    local = build_backend(tiny_model_dir, cfg, seed=0, lora=lora)
    start = {k: v.clone() for k, v in local.rollout_weights().items()}  # on CPU these alias the parameters
    ddp = build_backend(tiny_model_dir, cfg, BackendConfig(learner_backend="ddp", learner_workers=2), seed=0, lora=lora)
    try:
        assert ddp.lora_targets == local.lora_targets
        assert all(torch.equal(v, start[k]) for k, v in ddp.replica_weights(0).items())
        for _ in range(2):
            want, got = local.update(groups), ddp.update(groups)
            assert got["step"] == want["step"] and got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        mine, rank0, rank1 = local.rollout_weights(), ddp.replica_weights(0), ddp.replica_weights(1)
        assert set(rank0) == set(mine) and all(".lora_" in k for k in mine)  # adapter-only copies
        assert max(float((mine[k] - start[k]).abs().max()) for k in mine) > 1e-3
        assert max(float((rank0[k] - mine[k]).abs().max()) for k in mine) < 1e-5
        assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    finally:
        ddp.close()


def test_train_dry_run_checks_the_target_modules_against_the_model(tiny_model_dir, capsys):
    from arpo_algo.cli.main import main

    given = [
        "train",
        "quickstart",
        "--set",
        f"model.path={tiny_model_dir}",
        "--set",
        "model.lora.enabled=true",
        "--dry-run",
    ]
    assert main([*given, "--set", 'model.lora.target_modules=["q_proj", "v_proj"]']) == 0
    assert main([*given, "--set", 'model.lora.target_modules=["qproj"]']) == 2
    err = capsys.readouterr().err
    assert "['qproj'] are not linear layers" in err and "q_proj" in err


def test_an_adapter_chain_that_comes_back_on_itself_is_refused(lora_run, tmp_path):
    """Bug: the chain of bases was followed with no guard: a record whose base is the adapter itself (or a loop of
    two) hung the config lookup and overflowed the recursive check."""
    from arpo_algo.models import resolve_model_path

    a, b = tmp_path / "a", tmp_path / "b"
    for folder, base in ((a, b), (b, a)):
        shutil.copytree(lora_run["ckpt"] + "/policy", folder)
        record = json.loads((folder / ADAPTER_MARKER).read_text())
        (folder / ADAPTER_MARKER).write_text(json.dumps({**record, "base": str(base)}))
    with pytest.raises(ConfigError, match="comes back to"):
        resolve_model_path(a)


@pytest.mark.parametrize(
    "key, value",
    [("use_rslora", True), ("rank_pattern", {"q_proj": 4}), ("layers_to_transform", [0]), ("peft_new_option", "x")],
)
def test_an_adapter_config_arpo_would_not_apply_is_refused_by_key(lora_run, tmp_path, key, value):
    """Bug: only three PEFT keys were checked; an adapter with rsLoRA scaling, a rank pattern or a layer selection
    loaded as plain LoRA: another function than the one PEFT loads."""
    from arpo_algo.models.lora import load_policy_model

    folder = tmp_path / "adapter"
    shutil.copytree(lora_run["ckpt"] + "/policy", folder)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    load_policy_model(folder, dtype=None)  # as written by arpo: it loads
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, key: value}))
    with pytest.raises(ConfigError, match=f"uses {key} = "):
        load_policy_model(folder, dtype=None)


def test_behaviour_weights_that_miss_an_adapter_tensor_are_refused(lora_run):
    """Bug: stale-batch scoring loaded the behaviour adapter with strict=False and ignored what did not load, so
    a tensor missing from it was scored under the current adapter as if it were the old one."""
    from arpo_base.errors import ArpoError

    learner = lora_run["algo"].learner
    old = {k: v.clone() for k, v in learner.trainable_state().items()}
    with learner._weights_of(old):  # the whole adapter: loaded, and the learner's own put back after
        pass
    partial = dict(list(old.items())[1:])
    with pytest.raises(ArpoError, match="behaviour weights hold"):
        with learner._weights_of(partial):
            pass
    assert all(torch.equal(v, old[k]) for k, v in learner.trainable_state().items())  # nothing was changed
