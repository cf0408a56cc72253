"""Training with ``engine="vllm"``: one ARPO iteration in-process and one with two Ray rollout actors (needs vllm).

After the learner's weights move, the algorithm pushes its weights into the vLLM engine; the engine's greedy logprobs
must then equal a teacher-forced forward of the learner's model (the training path's weight sync, end to end).
"""

from __future__ import annotations

import time

import pytest
import torch

from arpo_algo.algorithms import ARPOConfig
from arpo_algo.rollout.engines.base import GenRequest, SamplingParams

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_tiny(tmp_path_factory):
    from arpo_algo.models import build_tiny_model

    # head_dim 64: vLLM's CPU attention kernels do not take the 16-dim heads of the default tiny model
    return build_tiny_model(tmp_path_factory.mktemp("vtrain") / "model", num_layers=2, hidden_size=256, seed=0)


def _config(model_dir, actors: int) -> ARPOConfig:
    return (
        ARPOConfig()
        .environment("arpo/ToolMath-v0", env_config={"levels": [1], "max_tool_calls": 1})
        .training(model_path=str(model_dir), prompts_per_step=1, lr=1e-2)
        .llm_rollouts(
            engine="vllm",
            max_response_tokens=16,
            num_rollout_actors=actors,
            num_cpus_per_rollout_actor=1 / max(actors, 1),
        )  # fits a 2-CPU machine
        .tree(budget=2, initial=1, entropy_method="topk_sum_lnV")
    )


def _engine_matches_learner(algo) -> None:
    model = algo.learner.model
    ctx = algo.learner.tokenizer.encode("after the update: ", add_special_tokens=False)
    gen = algo.engine.generate([GenRequest("w", ctx, SamplingParams(max_new_tokens=8, temperature=0))])[0]
    with torch.no_grad():
        logits = model(torch.tensor([ctx + gen.token_ids])).logits[0, len(ctx) - 1 : -1].float()
    ref = torch.log_softmax(logits, -1)[torch.arange(len(gen.token_ids)), torch.tensor(gen.token_ids)]
    assert (ref - torch.tensor(gen.logprobs)).abs().max().item() < 1e-4


@pytest.mark.parametrize("actors", [0, 2], ids=["in_process", "two_ray_actors"])
def test_arpo_iteration_on_vllm_and_weight_sync(vllm_tiny, actors):
    algo = _config(vllm_tiny, actors).build_algo()
    try:
        result = algo.train()
        assert result["training_iteration"] == 1 and result["num_trajectories"] >= 1.0
        # the iteration's push: bytes for all engines together, within the sync that contains it
        pushed = result["rollout"]["engine"]
        copy = sum(v.numel() * 4 for v in algo.learner.rollout_weights().values())  # float32 on the CPU engine
        assert max(actors, 1) * copy <= pushed["weight_push_bytes"] < max(actors, 1) * (copy + 2**20)
        assert 0 < pushed["weight_push_seconds"] <= result["timers"]["sync_time"]
        # a random tiny model earns no reward, so the update may be zero: move the weights as a learner step would
        torch.manual_seed(0)
        with torch.no_grad():
            for p in algo.learner.model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        t0 = time.perf_counter()
        algo._sync_weights()  # what the next training_step does first
        waited = time.perf_counter() - t0
        # the seconds are the wall time waited for the push: the actors load in parallel, so their own times added
        # up exceed it (measured with two actors: 0.098 s logged for a 0.074 s wait when they were added)
        assert 0 < algo.metrics.peek(("rollout", "engine", "weight_push_seconds")) <= waited
        _engine_matches_learner(algo)
    finally:
        algo.stop()


def test_a_lora_iteration_on_vllm_syncs_the_adapter_only(vllm_tiny):
    config = _config(vllm_tiny, 0).update_settings(
        {"model.lora.enabled": True, "model.lora.rank": 4, "model.lora.alpha": 8.0}
    )
    algo = config.build_algo()
    try:
        assert algo.engine.max_lora_rank == 8
        result = algo.train()
        assert result["training_iteration"] == 1 and result["num_trajectories"] >= 1.0
        adapter_bytes = sum(v.numel() * v.element_size() for v in algo.learner.rollout_weights().values())
        # the iteration's sync is in its metrics: a file of the adapter's tensors plus the safetensors header
        assert adapter_bytes <= result["rollout"]["engine"]["weight_push_bytes"] < 2 * adapter_bytes
        torch.manual_seed(0)
        with torch.no_grad():  # move the adapter as a learner step would (the base stays frozen)
            for p in algo.learner.model.parameters():
                if p.requires_grad:
                    p.add_(0.3 * torch.randn_like(p))
        algo._sync_weights()  # what the next training_step does first: vLLM replaces the adapter in place
        _engine_matches_learner(algo)
    finally:
        algo.stop()
