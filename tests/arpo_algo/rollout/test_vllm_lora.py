"""LoRA on the vLLM engine: a training run's adapter synced into vLLM, and named adapters served side by side.

The reference is a teacher-forced float32 forward of the PEFT model the adapter came from (the learner's side), to
the conformance tests' ``LOGP_TOL``. Two engine starts for the module (one per mode; 20-80 s each on 2 cores).
"""

from __future__ import annotations

import typing

import pytest
import torch

from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
from arpo_base.errors import ConfigError

pytestmark = pytest.mark.vllm
#: The engine conformance tests' float32 tolerance (vLLM CPU against a transformers forward: 1-3e-5 measured).
LOGP_TOL = 1e-4


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from arpo_algo.models import build_tiny_model

    # head_dim 64: vLLM's CPU attention kernels do not take the 16-dim heads of the default tiny model
    return build_tiny_model(tmp_path_factory.mktemp("vlora") / "model", num_layers=2, hidden_size=256, seed=0)


def _learner(base_dir, rank: int):
    """A PEFT model as the learner holds it: the base with a fresh adapter (``lora_B`` = 0) on the default targets."""
    from transformers import AutoModelForCausalLM

    from arpo_algo.models.lora import LoraSettings, attach_adapter, resolve_targets

    lora = LoraSettings(enabled=True, rank=rank, alpha=2.0 * rank)
    targets = resolve_targets(lora, base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    attach_adapter(model, lora, targets)
    return model.eval(), {"rank": rank, "alpha": 2.0 * rank, "target_modules": list(targets)}


def _adapter_state(model) -> dict[str, torch.Tensor]:
    """What the learner's ``rollout_weights()`` gives with LoRA: the trainable tensors under the module's names."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _move(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


def _logp(model, ctx: list[int], new: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ctx + new])).logits[0, len(ctx) - 1:-1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(new)), torch.tensor(new)]


def _greedy(engine, ctx, adapter=None, rid="r"):
    return GenRequest(rid, ctx, SamplingParams(max_new_tokens=10, temperature=0), adapter=adapter)


def test_the_rank_list_is_the_installed_vllms():
    from vllm.config.lora import MaxLoRARanks

    from arpo_algo.rollout.engines.config import VLLM_LORA_RANKS

    assert VLLM_LORA_RANKS == tuple(sorted(typing.get_args(MaxLoRARanks)))


def test_adapter_syncs_replace_the_adapter_and_match_the_learner(base_dir):
    from arpo_algo.rollout.engines.vllm import VLLMEngine

    learner, layout = _learner(base_dir, rank=4)
    engine = VLLMEngine(base_dir, dtype="float32", kv_cache_gib=0.25, seed=0, lora=layout)
    try:
        assert engine.max_lora_rank == 8  # the smallest value vLLM accepts that holds rank 4
        ctx = engine.tokenizer.encode("adapters move: ", add_special_tokens=False)
        before = engine.generate([_greedy(engine, ctx)])[0]  # no sync yet: the base, what lora_B = 0 computes
        assert (_logp(learner, ctx, before.token_ids) - torch.tensor(before.logprobs)).abs().max() < LOGP_TOL
        outputs = [before.logprobs]
        for seed in (1, 2):  # the second sync replaces the adapter vLLM already holds under the same id
            _move(learner, seed)
            engine.load_state_dict(_adapter_state(learner))
            stats = engine.stats()
            gen = engine.generate([_greedy(engine, ctx)])[0]
            assert gen.logprobs != pytest.approx(outputs[-1], abs=1e-3)
            assert (_logp(learner, ctx, gen.token_ids) - torch.tensor(gen.logprobs)).abs().max() < LOGP_TOL
            outputs.append(gen.logprobs)
            full_bytes = sum(p.numel() * 4 for n, p in learner.named_parameters() if not p.requires_grad)
            assert stats["weight_loads"] == 1 and 0 < stats["weight_push_bytes"] < full_bytes / 10
            assert stats["weight_push_seconds"] > 0
        # bad pushes are refused before anything is sent, and the adapter in use stays
        full = {n: p.detach() for n, p in learner.named_parameters() if not p.requires_grad}
        with pytest.raises(ConfigError, match="not the engine's adapter") as e:
            engine.load_state_dict(full)
        assert "rollout_weights" in e.value.hint
        other, _ = _learner(base_dir, rank=8)
        with pytest.raises(ConfigError, match=r"rank 4.*lora_A\.default\.weight \(8, 256\)"):
            engine.load_state_dict(_adapter_state(other))
        again = engine.generate([_greedy(engine, ctx)])[0]
        assert again.logprobs == pytest.approx(outputs[-1], abs=LOGP_TOL)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    from arpo_algo.models import build_tiny_adapter, build_tiny_model

    root = tmp_path_factory.mktemp("vlora_adapters")
    other = build_tiny_model(root / "other", num_layers=2, hidden_size=256, seed=9)
    return {"a": build_tiny_adapter(base_dir, root / "a", rank=4, seed=1),
            "b": build_tiny_adapter(base_dir, root / "b", rank=8, seed=2),
            "wide": build_tiny_adapter(base_dir, root / "wide", rank=16, seed=3),
            "x": build_tiny_adapter(other, root / "x", rank=4, seed=4)}


def test_named_adapters_in_one_batch_answer_as_each_alone(base_dir, adapters):
    from arpo_algo.models.lora import load_policy_model
    from arpo_algo.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(base_dir, dtype="float32", kv_cache_gib=0.25, seed=0,
                        adapters={"a": str(adapters["a"]), "b": str(adapters["b"])})
    try:
        assert engine.max_lora_rank == 8 and engine.llm.llm_engine.vllm_config.lora_config.max_loras == 2
        ctx = engine.tokenizer.encode("which agent am I? ", add_special_tokens=False)
        alone = {n: engine.generate([_greedy(engine, ctx, n)])[0] for n in ("a", "b", None)}
        assert all(g.finish_reason == "length" for g in alone.values())
        mixed = engine.generate([_greedy(engine, ctx, "a", "1"), _greedy(engine, ctx, "b", "2"),
                                 _greedy(engine, ctx, None, "3")])
        # a base row beside adapter rows: vLLM's CPU kernels gave it an adapter in one batch, so the engine splits it
        for gen, name in zip(mixed, ("a", "b", None)):
            assert gen.token_ids == alone[name].token_ids
            assert gen.logprobs == pytest.approx(alone[name].logprobs, abs=LOGP_TOL)
        assert alone["a"].logprobs != pytest.approx(alone["b"].logprobs, abs=1e-3)
        for name in ("a", "b", None):  # each equals its adapter applied by PEFT on the base (None: the base)
            teacher = load_policy_model(adapters.get(name, base_dir), dtype=torch.float32).eval()
            assert (_logp(teacher, ctx, alone[name].token_ids)
                    - torch.tensor(alone[name].logprobs)).abs().max() < LOGP_TOL
        with pytest.raises(ConfigError, match="rank 16 exceeds this vLLM engine's max_lora_rank 8"):
            engine.add_adapter("wide", str(adapters["wide"]))
        with pytest.raises(ConfigError, match="trained on the base with weights fingerprint"):
            engine.add_adapter("x", str(adapters["x"]))
        assert engine.generate([_greedy(engine, ctx, "wide")])[0].finish_reason == "error"  # nothing half-loaded
        engine.remove_adapter("b")
        assert engine.generate([_greedy(engine, ctx, "b")])[0].finish_reason == "error"
        engine.add_adapter("b2", str(adapters["b"]))
        assert engine.generate([_greedy(engine, ctx, "b2")])[0].token_ids == alone["b"].token_ids
    finally:
        engine.close()
