"""ARPO with the ``ddp`` learner backend end to end on CPU (2 ranks over gloo, in-process engine with its own copy),
and the learner-backend settings as ARPOConfig options."""

from __future__ import annotations

import pytest
import torch

from arpo_algo.algorithms import ARPO, ARPOConfig
from arpo_algo.train.backend_config import BackendConfig
from arpo_algo.train.deepspeed_learner import DeepSpeedBackend, deepspeed_config
from arpo_algo.train.learner import LearnerConfig
from arpo_base.errors import ConfigError
from tests.arpo_algo.algorithms.test_algorithm import tiny_config


def test_arpo_trains_with_two_ddp_ranks_and_syncs_rank0_weights(tiny_model_dir, tmp_path):
    import ray
    from transformers import AutoModelForCausalLM

    if ray.is_initialized():  # the Algorithm must start (and stop) its own Ray here
        ray.shutdown()
    cfg = (
        tiny_config(tiny_model_dir)
        .training(entropy_coef=0.01)
        .backend(learner_backend="ddp", learner_workers=2, learner_cpus_per_worker=0.5)
    )
    algo = cfg.build_algo()
    try:
        assert ray.is_initialized() and algo.learner.num_workers == 2
        assert algo.engine.model is not None and algo.learner.shared_module is None  # the engine owns a copy
        result = algo.train()
        assert result["learner"]["learner_workers"] == 2 and result["learner"]["step"] == 1
        rank0 = algo.learner.replica_weights(0)
        engine = {k: v.detach().clone() for k, v in algo.engine.model.state_dict().items()}
        assert any(not torch.equal(engine[k], rank0[k]) for k in rank0)  # the engine still has the old weights
        algo._sync_weights()  # what the next iteration does first: rank 0's weights into the engine
        assert all(torch.equal(v, rank0[k]) for k, v in algo.engine.model.state_dict().items())
        algo.save_to_path(str(tmp_path / "ckpt"))
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "policy").state_dict()
        assert all(torch.equal(saved[k], rank0[k]) for k in rank0)
    finally:
        algo.stop()
    assert not ray.is_initialized()  # started by the Algorithm, so stopped by it


def test_a_bf16_in_process_engine_trains_with_ddp_ranks(tiny_model_dir):
    """With ddp the learner's modules live in the rank actors, so the in-process engine loads its own copy: it may
    run in bfloat16 (only an engine sharing the local learner's float32 module is held to float32)."""
    import ray

    from arpo_algo.train.learner_config import MISMATCH_LEVELS

    if ray.is_initialized():  # the Algorithm must start (and stop) its own Ray here
        ray.shutdown()
    cfg = (
        tiny_config(tiny_model_dir)
        .training(entropy_coef=0.01)
        .llm_rollouts(dtype="bfloat16")
        .backend(learner_backend="ddp", learner_workers=2, learner_cpus_per_worker=0.5)
    )
    algo = cfg.build_algo()
    try:
        assert algo.learner.shared_module is None and algo.engine.dtype == "bfloat16"
        assert next(algo.engine.model.parameters()).dtype == torch.bfloat16
        # the alarm judges the bf16 sampler against the float32 ranks at the bf16-sampler levels
        assert algo.learner.config.mismatch_levels("fp32") == MISMATCH_LEVELS["bf16_sampler"]
        result = algo.train()
        assert result["learner"]["step"] == 1 and result["learner"]["param_change_norm"] > 0
        assert 0 < result["learner"]["logprob_diff_max"]  # bf16 rounding: scored by the float32 ranks
        rank0 = algo.learner.replica_weights(0)
        algo._sync_weights()  # rank 0's float32 weights, rounded into the engine's bfloat16 copy
        engine = algo.engine.model.state_dict()
        assert all(torch.equal(engine[k], v.to(torch.bfloat16)) for k, v in rank0.items())
    finally:
        algo.stop()


def test_backend_options_are_arpo_settings():
    cfg = ARPOConfig().backend(learner_backend="ddp", learner_workers=2)
    assert cfg.settings.backend == BackendConfig(learner_backend="ddp", learner_workers=2)
    assert cfg.settings.sections()["backend"]["learner_backend"] == "ddp"
    with pytest.raises(ConfigError, match="learner_workers"):
        ARPOConfig().backend(learner_workers="two")
    with pytest.raises(ConfigError, match="unknown key 'learner_workers'"):  # one place per setting
        ARPOConfig().training(learner_workers=2)
    bad = (
        ARPOConfig()
        .environment("arpo/ToolMath-v0")
        .training(model_path="x")
        .backend(learner_backend="deepspeed", deepspeed_offload="optimizer")
    )
    with pytest.raises(ConfigError, match="offloading to it would move nothing"):  # the learner is in CPU memory
        bad.validate()


def test_a_placement_the_machine_cannot_hold_fails_before_setup():
    import ray

    if ray.is_initialized():  # this checks the machine's own resources, without a Ray cluster
        ray.shutdown()
    gpus = torch.cuda.device_count()
    cfg = (
        ARPOConfig()
        .environment("arpo/ToolMath-v0")
        .training(model_path="x")
        .backend(learner_backend="ddp", learner_workers=gpus + 2)
        .llm_rollouts(device="cuda")
    )
    with pytest.raises(ConfigError) as err:
        ARPO.default_resource_request(cfg)
    msg = err.value.message
    assert f"and {gpus + 3:g} GPU(s) (1 for the main process + {gpus + 2} learner worker(s) x 1; " in msg
    assert f"but this machine has {__import__('os').cpu_count()} CPUs and {gpus} GPU(s)" in msg


def test_deepspeed_without_the_extra_is_a_config_error_naming_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if the extra were not installed (find_spec -> None)
    with pytest.raises(ConfigError, match="deepspeed package") as err:
        DeepSpeedBackend(
            "unused", LearnerConfig(), BackendConfig(learner_backend="deepspeed", learner_workers=2), device="cuda"
        )
    assert "arpo[deepspeed]" in err.value.hint
    cfg = ARPOConfig().environment("arpo/ToolMath-v0").training(model_path="x").backend(learner_backend="deepspeed")
    with pytest.raises(ConfigError, match="deepspeed package"):  # with the settings, before anything starts
        cfg.validate()


@pytest.mark.parametrize("stage, bf16", [(2, False), (3, True)])
def test_generated_deepspeed_config(stage, bf16):
    ds = deepspeed_config(LearnerConfig(grad_clip=0.5), stage, bf16=bf16)
    assert ds["zero_optimization"]["stage"] == stage and ds["bf16"] == {"enabled": bf16}
    assert ds["gradient_clipping"] == 0.5 and ds["fp16"] == {"enabled": False}
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["gradient_accumulation_steps"] == 1
    assert ("stage3_gather_16bit_weights_on_model_save" in ds["zero_optimization"]) == (stage == 3)
    assert "offload_optimizer" not in ds["zero_optimization"]
    off = deepspeed_config(LearnerConfig(), 3, offload="optimizer_and_parameters")
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert off["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert off["zero_force_ds_cpu_optimizer"] is False  # arpo's AdamW steps the offloaded state
    with pytest.raises(ConfigError, match="deepspeed_stage"):
        deepspeed_config(LearnerConfig(), 1)
