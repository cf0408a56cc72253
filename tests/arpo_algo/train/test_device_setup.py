"""Precision, tree-attention choice and the deterministic switch, resolved per device."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from arpo_algo.train.device_setup import (
    bf16_capability,
    cpu_capability,
    make_deterministic,
    resolve_precision,
    resolve_tree_attention,
)
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_algo.train.learner_config import ALARM_OFF
from arpo_base.errors import ConfigError
from tests.arpo_algo.train.test_tree_forward import make_groups

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# Hand-built behaviour log-probs are not the model's: the rollout/learner mismatch alarm would (rightly) stop.
BASE = LearnerConfig(lr=1e-3, grad_clip=0.0, micro_batch_tokens=100_000, **ALARM_OFF)


def test_precision_defaults_per_device(monkeypatch):
    assert resolve_precision("auto", CPU) == "fp32"
    assert resolve_precision("bf16", CPU) == "bf16"  # CPU autocast to bfloat16 is allowed when asked for
    assert resolve_precision("fp32", CUDA) == "fp32"
    with pytest.raises(ConfigError, match="precision='half' is not one of 'auto', 'fp32', 'bf16', 'native'"):
        LearnerConfig(precision="half").validate()
    # A GPU without native bfloat16 (e.g. a V100): auto falls back to fp32, an explicit bf16 is refused.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_precision("auto", CUDA) == "fp32"
    with pytest.raises(ConfigError, match="this GPU has no native bfloat16") as err:
        resolve_precision("bf16", CUDA)
    assert "fp32" in err.value.hint
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert resolve_precision("auto", CUDA) == "bf16"


def test_native_precision_is_bf16_exactly_where_the_hardware_multiplies_bf16(monkeypatch):
    native_cpu, plain_cpu = bf16_capability({"avx2", "avx512f", "avx512_bf16"}), bf16_capability({"avx2", "avx512f"})
    assert resolve_precision("native", CPU, native_cpu) == "bf16"
    assert resolve_precision("native", CPU, plain_cpu) == "fp32"
    assert resolve_precision("native", CPU, bf16_capability(None)) == "fp32"  # unknown flags: never emulated bf16
    # without a record, this machine's own flags decide
    assert resolve_precision("native", CPU) == ("bf16" if cpu_capability()["native_bf16_matmul"] else "fp32")
    # "auto" keeps its meaning: fp32 on every CPU, whatever its flags
    assert resolve_precision("auto", CPU, native_cpu) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_precision("native", CUDA, native_cpu) == "fp32"  # a GPU without bf16: its own answer counts
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert resolve_precision("native", CUDA, plain_cpu) == "bf16"


def test_cpu_bf16_capability_comes_from_the_flags_and_unknown_counts_as_not_native():
    assert bf16_capability({"avx2", "avx512f", "avx512_bf16"}) == {
        "flags_known": True,
        "flags": ["avx2", "avx512f", "avx512_bf16"],
        "native_bf16_matmul": True,
    }
    assert bf16_capability({"avx2", "amx_bf16", "amx_tile"})["native_bf16_matmul"] is True  # AMX without AVX512-BF16
    assert bf16_capability({"avx2", "avx512f"})["native_bf16_matmul"] is False
    assert bf16_capability(None) == {"flags_known": False, "flags": [], "native_bf16_matmul": False}
    # this machine, read from the OS (Linux: the first CPU's flags line)
    mine = cpu_capability()
    try:
        line = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    except OSError:
        assert mine == bf16_capability(None)
    else:
        assert mine["native_bf16_matmul"] == ("avx512_bf16" in line or "amx_bf16" in line)
        assert mine["flags_known"] and ("avx2" in mine["flags"]) == ("avx2" in line)


def test_tree_attention_auto_per_device():
    def pick(choice: str, device: torch.device, impl: str = "sdpa", det: bool = False) -> str:
        return resolve_tree_attention(choice, device, attn_implementation=impl, deterministic=det)

    assert pick("auto", CUDA) == "flex"
    assert pick("auto", CPU) == "dense"
    assert pick("auto", CUDA, impl="eager") == "dense"
    assert pick("auto", CUDA, det=True) == "dense"  # deterministic: SDPA, whose deterministic kernels torch documents
    assert pick("flex", CUDA, det=True) == "flex"  # asked for explicitly: torch raises if it has no such kernel
    assert pick("dense", CUDA) == "dense"


@pytest.fixture
def restore_determinism():
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    if env is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = env
    torch.use_deterministic_algorithms(flags[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[1:]


def test_deterministic_switch(tiny_model_dir, restore_determinism, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    groups = make_groups(AutoTokenizer.from_pretrained(tiny_model_dir))
    runs = []
    for _ in range(2):
        learner = Learner(tiny_model_dir, replace(BASE, deterministic=True), seed=3)
        m = learner.update(groups)
        assert m["skipped_nan"] == 0 and math.isfinite(m["grad_norm"])
        runs.append({n: p.detach().clone() for n, p in learner.model.named_parameters()})
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    for name, p in runs[0].items():  # every op of the update had a deterministic kernel (else torch raises)
        assert torch.equal(p, runs[1][name]), name
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG=':0:0', which leaves cuBLAS non-deterministic"):
        make_deterministic()


@pytest.mark.gpu
def test_bf16_is_the_cuda_default_with_fp32_master_weights(tiny_model_dir):
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bfloat16, so 'auto' resolves to fp32 (covered on CPU)")
    groups = make_groups(AutoTokenizer.from_pretrained(tiny_model_dir))
    learner = Learner(tiny_model_dir, BASE, device="cuda")
    assert learner.precision == "bf16" and learner.tree_attention == "flex"
    m = learner.update(groups)
    assert m["skipped_nan"] == 0 and m["grad_norm"] > 0 and math.isfinite(m["loss/policy"])
    for p in learner.model.parameters():
        assert p.dtype == torch.float32
        state = learner.optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert learner.optimizer.defaults["fused"] is True  # fused AdamW on CUDA


@pytest.mark.gpu
def test_gradient_checkpointing_on_gpu_gives_the_same_gradients(tiny_model_dir):
    groups = make_groups(AutoTokenizer.from_pretrained(tiny_model_dir))
    grads = []
    for ckpt in (False, True):
        learner = Learner(tiny_model_dir, replace(BASE, precision="fp32", gradient_checkpointing=ckpt), device="cuda")
        learner.update(groups)
        grads.append({n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4)
