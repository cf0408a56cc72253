"""LoRA on the vLLM engine: a training run's adapter synced into vLLM, and named adapters served side by side.

The reference is a teacher-forced float32 forward of the PEFT model the adapter came from (the learner's side), to
the conformance tests' ``LOGP_TOL``. Two engine starts for the module (one per mode; 20-80 s each on 2 cores).
"""

from __future__ import annotations

import json
import os
import tempfile
import typing
from pathlib import Path

import pytest
import torch

from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
from arpo_base.errors import ConfigError
from arpo_base.procs import cmdline

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
    return model.eval(), LoraSettings(enabled=True, rank=rank, alpha=2.0 * rank, target_modules=tuple(targets))


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
        logits = model(torch.tensor([ctx + new])).logits[0, len(ctx) - 1 : -1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(new)), torch.tensor(new)]


def _greedy(engine, ctx, adapter=None, rid="r"):
    return GenRequest(rid, ctx, SamplingParams(max_new_tokens=10, temperature=0), adapter=adapter)


def test_the_rank_list_is_the_installed_vllms():
    from vllm.config.lora import MaxLoRARanks

    from arpo_algo.rollout.engines.config import VLLM_LORA_RANKS

    assert VLLM_LORA_RANKS == tuple(sorted(typing.get_args(MaxLoRARanks)))


def test_adapter_syncs_replace_the_adapter_and_match_the_learner(base_dir):
    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

    learner, layout = _learner(base_dir, rank=4)
    # transport "bytes" (for a small /dev/shm): the adapter folder is not put in /dev/shm either
    engine = VLLMEngine(base_dir, dtype="float32", kv_cache_gib=0.25, seed=0, lora=layout, transport="bytes")
    try:
        assert engine.max_lora_rank == 8  # the smallest value vLLM accepts that holds rank 4
        assert Path(engine._lora_root).parent == Path(tempfile.gettempdir())
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
        state = _adapter_state(learner)
        partial = {k: v for k, v in state.items() if k != next(k for k in state if ".lora_B." in k)}
        with pytest.raises(ConfigError, match=r"missing: \S+\.lora_B\.default\.weight"):
            engine.load_state_dict(partial)  # one module without its lora_B
        name_a = next(k for k in state if ".lora_A." in k)
        wide = {**state, name_a: torch.zeros(4, state[name_a].shape[1] + 1)}
        with pytest.raises(ConfigError, match=rf"wrong shapes: {name_a} \(4, 257\) \(expected \(4, 256\)\)"):
            engine.load_state_dict(wide)
        again = engine.generate([_greedy(engine, ctx)])[0]
        assert again.logprobs == pytest.approx(outputs[-1], abs=LOGP_TOL)
    finally:
        engine.close()
    assert not os.path.exists(engine._lora_root)


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    from arpo_algo.models import build_tiny_adapter, build_tiny_model

    root = tmp_path_factory.mktemp("vlora_adapters")
    other = build_tiny_model(root / "other", num_layers=2, hidden_size=256, seed=9)
    return {
        "a": build_tiny_adapter(base_dir, root / "a", rank=4, seed=1),
        "b": build_tiny_adapter(base_dir, root / "b", rank=8, seed=2),
        "c": build_tiny_adapter(base_dir, root / "c", rank=4, seed=5),
        "wide": build_tiny_adapter(base_dir, root / "wide", rank=16, seed=3),
        "x": build_tiny_adapter(other, root / "x", rank=4, seed=4),
    }


def _tampered(adapter: Path, dest: Path, change) -> Path:
    """A copy of an adapter folder whose tensors ``change(tensors)`` edited (config and base record kept)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, dest)
    tensors = load_file(dest / "adapter_model.safetensors")
    change(tensors)
    save_file(tensors, dest / "adapter_model.safetensors", metadata={"format": "pt"})
    return dest


def test_named_adapters_in_one_batch_answer_as_each_alone(base_dir, adapters):
    from arpo_algo.models.lora import load_policy_model
    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

    # one LoRA slot for three adapters: vLLM must still answer a batch that names all of them
    engine = VLLMEngine(
        base_dir,
        dtype="float32",
        kv_cache_gib=0.25,
        seed=0,
        max_loras=1,
        adapters={n: str(adapters[n]) for n in ("a", "b", "c")},
    )
    try:
        assert engine.max_lora_rank == 8 and engine.llm.llm_engine.vllm_config.lora_config.max_loras == 1
        assert Path(engine._lora_root).parent == Path(tempfile.gettempdir())  # serving's copies: not in /dev/shm
        ctx = engine.tokenizer.encode("which agent am I? ", add_special_tokens=False)
        alone = {n: engine.generate([_greedy(engine, ctx, n)])[0] for n in ("a", "b", "c", None)}
        assert all(g.finish_reason == "length" for g in alone.values())
        order = (None, "a", None, "b", "c")  # the base rows interleaved: their split must not reorder the results
        mixed = engine.generate([_greedy(engine, ctx, name, str(i)) for i, name in enumerate(order)])
        # a base row beside adapter rows: vLLM's CPU kernels gave it an adapter in one batch, so the engine splits it
        for gen, name in zip(mixed, order):
            assert gen.token_ids == alone[name].token_ids
            assert gen.logprobs == pytest.approx(alone[name].logprobs, abs=LOGP_TOL)
        assert len({tuple(alone[n].token_ids) for n in ("a", "b", "c")}) > 1
        assert alone["a"].logprobs != pytest.approx(alone["b"].logprobs, abs=1e-3)
        for name in ("a", "b", None):  # each equals its adapter applied by PEFT on the base (None: the base)
            teacher = load_policy_model(adapters.get(name, base_dir), dtype=torch.float32).eval()
            assert (
                _logp(teacher, ctx, alone[name].token_ids) - torch.tensor(alone[name].logprobs)
            ).abs().max() < LOGP_TOL
        with pytest.raises(ConfigError, match="rank 16 exceeds this vLLM engine's max_lora_rank 8"):
            engine.add_adapter("wide", str(adapters["wide"]))
        with pytest.raises(ConfigError, match="trained on the base with weights fingerprint"):
            engine.add_adapter("x", str(adapters["x"]))
        assert engine.generate([_greedy(engine, ctx, "wide")])[0].finish_reason == "error"  # nothing half-loaded
        # tensors vLLM would only meet at the first request: one it cannot place (which killed the engine process
        # every agent shares) and one of the wrong shape (which was served without an error)
        root = Path(adapters["a"]).parent
        stray = "base_model.model.model.layers.0.self_attn.foo_proj.lora_A.weight"
        extra = _tampered(adapters["a"], root / "extra", lambda t: t.__setitem__(stray, torch.zeros(4, 256)))
        down = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
        narrow = _tampered(adapters["a"], root / "narrow", lambda t: t.__setitem__(down, t[down][:, :-1].contiguous()))
        fan_in = json.loads((Path(base_dir) / "config.json").read_text())["intermediate_size"]  # down_proj's input
        for name, folder, what in (
            ("extra", extra, rf"unknown tensors: {stray} \(4, 256\)"),
            (
                "narrow",
                narrow,
                rf"wrong shapes: {down} \(4, {fan_in - 1}\) "
                rf"\(expected \(4, {fan_in}\)\)",
            ),
        ):
            with pytest.raises(ConfigError, match=what):
                engine.add_adapter(name, str(folder))
            assert name not in engine.adapters
        assert engine.alive()
        again = engine.generate([_greedy(engine, ctx, "a")])[0]
        assert again.token_ids == alone["a"].token_ids
        assert again.logprobs == pytest.approx(alone["a"].logprobs, abs=LOGP_TOL)
        engine.remove_adapter("b")
        assert engine.generate([_greedy(engine, ctx, "b")])[0].finish_reason == "error"
        engine.add_adapter("b2", str(adapters["b"]))
        assert engine.generate([_greedy(engine, ctx, "b2")])[0].token_ids == alone["b"].token_ids
    finally:
        engine.close()


def _started_processes(before: set[int] | None = None) -> list:
    """This process's descendants (not in ``before``), without multiprocessing's resource tracker, which vLLM's start
    leaves behind by design: it lives as long as this process. Zombies and processes that end meanwhile are not
    started processes (an earlier test may have left one unreaped)."""
    from arpo_base.procs import cmdline, descendants

    return [p for p in descendants() if p.pid not in (before or set()) and "resource_tracker" not in (cmdline(p) or "")]


def test_a_registration_that_fails_at_start_leaves_no_engine_process_or_folder(base_dir, adapters, monkeypatch):
    import errno
    import shutil

    import psutil

    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine
    from arpo_base.errors import ArpoError

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = {p.pid for p in _started_processes()}
    leftovers = set(Path(tempfile.gettempdir()).glob("arpo-lora-*"))
    monkeypatch.setattr(shutil, "copyfile", full)  # the disk fills up while the adapter copies are written
    with pytest.raises(ArpoError, match="No space left on device") as e:
        VLLMEngine(base_dir, dtype="float32", kv_cache_gib=0.25, seed=0, adapters={"a": str(adapters["a"])})
    assert "transport = 'bytes'" in e.value.hint and "/dev/shm" in e.value.hint
    assert set(Path(tempfile.gettempdir()).glob("arpo-lora-*")) == leftovers
    _, alive = psutil.wait_procs(_started_processes(before), timeout=30)
    assert not alive, [cmdline(p) for p in alive]


def test_an_architecture_vllm_has_no_lora_for_is_refused_before_vllm_starts(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from arpo_algo.models.lora import LoraSettings
    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128, n_positions=64)).save_pretrained(
        tmp_path / "gpt2"
    )
    before = {p.pid for p in _started_processes()}
    with pytest.raises(ConfigError, match="cannot run LoRA adapters on architecture GPT2LMHeadModel") as e:
        VLLMEngine(
            tmp_path / "gpt2",
            dtype="float32",
            kv_cache_gib=0.25,
            lora=LoraSettings(enabled=True, rank=4, alpha=8.0, target_modules=("c_attn",)),
        )
    assert "rollouts.engine = 'hf'" in e.value.hint
    assert not _started_processes(before)
