"""VLLMEngine: only in the GPU image (vllm + CUDA); here only the missing-package error is checked."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from arpo_algo.core.entropy import topk_sum_lnV, topk_token_term
from arpo_algo.rollout.engines.base import GenRequest, RolloutEngine, SamplingParams
from arpo_env.errors import ArpoError, ConfigError

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed, so the missing-package error cannot happen")
def test_missing_vllm_is_a_clear_error(tiny_model_dir):
    from arpo_algo.rollout.engines.vllm import VLLMEngine

    with pytest.raises(ArpoError, match="GPU image"):
        VLLMEngine(tiny_model_dir)
    with pytest.raises(ConfigError, match="top-k"):
        VLLMEngine(tiny_model_dir, entropy_method="full")


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    from arpo_algo.models import build_tiny_model

    # head_dim 64: vLLM's attention kernels do not support the 16-dim heads of the default tiny model
    return build_tiny_model(tmp_path_factory.mktemp("vtiny") / "model", num_layers=2, hidden_size=256, seed=0)


@pytest.fixture(scope="module")
def engine(vllm_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from arpo_algo.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(vllm_model_dir, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)


@pytest.mark.vllm
@pytest.mark.gpu
def test_vllm_logprobs_match_hf_teacher_forcing(engine, vllm_model_dir):
    from transformers import AutoModelForCausalLM

    assert isinstance(engine, RolloutEngine)
    ctx = engine.tokenizer.encode("hello vllm", add_special_tokens=False)
    gen = engine.generate([GenRequest("a", ctx, SamplingParams(max_new_tokens=12, seed=0))])[0]
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ctx + gen.token_ids])).logits[0, len(ctx) - 1:-1].float(), -1)
    ref = logp[torch.arange(len(gen.token_ids)), torch.tensor(gen.token_ids)].tolist()
    assert max(abs(a - b) for a, b in zip(ref, gen.logprobs)) < 1e-2
    assert all(tok in dict(top) for tok, top in zip(gen.token_ids, gen.top_logprobs))
    assert gen.entropies == pytest.approx([topk_token_term(t) for t in gen.top_logprobs])
    assert math.isfinite(topk_sum_lnV(gen.top_logprobs, len(engine.tokenizer.get_vocab())))


@pytest.mark.vllm
@pytest.mark.gpu
def test_vllm_seed_stop_and_errors(engine):
    tok = engine.tokenizer
    ctx = tok.encode("stop test", add_special_tokens=False)
    free = engine.generate([GenRequest("f", ctx, SamplingParams(max_new_tokens=24, seed=7))])[0]
    again = engine.generate([GenRequest("g", ctx, SamplingParams(max_new_tokens=24, seed=7))])[0]
    assert free.token_ids == again.token_ids
    stop = tok.decode(free.token_ids[5:7])
    gen = engine.generate([GenRequest("s", ctx, SamplingParams(max_new_tokens=24, seed=7, stop=(stop,)))])[0]
    assert gen.finish_reason == "stop" and gen.stop_string == stop and stop in tok.decode(gen.token_ids)
    bad = GenRequest("too-long", [65] * (engine.max_model_len + 5), SamplingParams(max_new_tokens=4))
    res = engine.generate([bad, GenRequest("ok", ctx, SamplingParams(max_new_tokens=4, seed=1))])
    assert res[0].finish_reason == "error" and "too-long" in res[0].error and res[1].finish_reason == "length"


@pytest.mark.vllm
@pytest.mark.gpu
def test_vllm_weight_update(engine, vllm_model_dir):
    from transformers import AutoModelForCausalLM

    ctx = engine.tokenizer.encode("weights", add_special_tokens=False)
    req = GenRequest("w", ctx, SamplingParams(max_new_tokens=8, temperature=0))
    before = engine.generate([req])[0]
    sd = AutoModelForCausalLM.from_pretrained(vllm_model_dir).state_dict()
    torch.manual_seed(1)
    sd = {k: v + 0.5 * torch.randn_like(v) if k.endswith("norm.weight") else v for k, v in sd.items()}
    engine.load_state_dict(sd)
    after = engine.generate([req])[0]
    assert after.logprobs != before.logprobs
