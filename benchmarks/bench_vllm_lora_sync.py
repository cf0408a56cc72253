"""Bytes and seconds of one weight sync into the vLLM engine: the full state dict against a LoRA adapter.

One process, side by side: a VLLMEngine of ``--model`` takes ``--repeats`` pushes of the model's full state dict
(``load_state_dict``: a safetensors file in shared memory, reloaded and repacked by the worker), then a LoRA engine
of the same model takes as many adapter-only syncs (the learner's adapter tensors of rank ``--rank`` on the family's
default target modules: a folder in shared memory, re-issued to vLLM with ``load_inplace=True``). Bytes and seconds
are the engine's own ``weight_push_bytes`` / ``weight_push_seconds`` counters; the median over the repeats is
reported (the first push of each engine included: there is no warm-up to hide). Needs vllm.

    python -m benchmarks.bench_vllm_lora_sync [--model smollm2-135m-instruct] [--rank 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch


def _pushes(engine: Any, states: list[dict[str, Any]]) -> tuple[float, float]:
    """Median (bytes, seconds) of one ``load_state_dict`` per state, from the engine's counters."""
    sizes, secs = [], []
    engine.stats()
    for state in states:
        engine.load_state_dict(state)
        s = engine.stats()
        sizes.append(s["weight_push_bytes"])
        secs.append(s["weight_push_seconds"])
    return statistics.median(sizes), statistics.median(secs)


def measure(model: str, rank: int, repeats: int, kv_cache_gib: float) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from arpo_algo.models import resolve_model_path
    from arpo_algo.models.lora import LoraSettings, attach_adapter, resolve_targets
    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

    path = resolve_model_path(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full_state = hf.state_dict()
    engine = VLLMEngine(path, dtype="float32", kv_cache_gib=kv_cache_gib, seed=0)
    try:
        full = _pushes(engine, [full_state] * repeats)
    finally:
        engine.close()
    lora = LoraSettings(enabled=True, rank=rank, alpha=2.0 * rank)
    targets = resolve_targets(lora, path)
    attach_adapter(hf, lora, targets)
    states = []
    for i in range(repeats):  # a different adapter each sync, as after every update
        with torch.no_grad():
            for p in hf.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.01)
        states.append({n: p.detach().clone() for n, p in hf.named_parameters() if p.requires_grad})
    engine = VLLMEngine(
        path,
        dtype="float32",
        kv_cache_gib=kv_cache_gib,
        seed=0,
        lora=LoraSettings(enabled=True, rank=rank, alpha=2.0 * rank, target_modules=tuple(targets)),
    )
    try:
        adapter = _pushes(engine, states)
    finally:
        engine.close()
    return {
        "model": model,
        "rank": rank,
        "repeats": repeats,
        "full_bytes": full[0],
        "full_seconds": full[1],
        "lora_bytes": adapter[0],
        "lora_seconds": adapter[1],
        "bytes_ratio": adapter[0] / full[0],
        "seconds_ratio": adapter[1] / full[1],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.model, args.rank, args.repeats, args.kv_cache_gib), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
