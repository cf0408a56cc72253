"""Estimate per-GPU memory and step time of a GPU recipe from figures measured on one H100 (listed in INPUTS).

An ESTIMATE, not a measurement: no GPU run of these recipes has been made. Every input is printed with its source;
the ones marked "assumption" or "spec" were not measured by us. Usage::

    python -m arpo_algo.run.estimate_gpu gpu_reasoning_qwen25_7b --gpus 8 --zero 3
    python -m arpo_algo.run.estimate_gpu experiments/gpu/gpu_deepsearch_qwen3_8b.toml --gpus 8 --zero 3 --json out.json

Model (per GPU, ``G`` GPUs, ``P`` parameters):

* learner state: fp32 weights, fp32 gradients, fp32 AdamW moments = 16 bytes per parameter (the learner keeps fp32
  master weights and optimizer state; bf16 autocast only changes the compute), split by DeepSpeed ZeRO stage
  ``--zero``: 0 none, 1 optimizer state / G, 2 + gradients / G, 3 + weights / G;
* activations of one micro-batch (``[training] micro_batch_tokens``): ``a * layers * hidden + b * vocab`` bytes per
  token, with ``a`` and ``b`` fitted to the four bf16 peak-memory figures of docs/results/gpu-h100.md#learner
  (SmolLM2-135M and the 1.5B
  shape, duplicated and deduplicated); with gradient checkpointing only each layer's fp32 input is kept, plus one
  layer's activations and the logits (an assumption: checkpointing was not measured);
* rollout engine (vLLM, colocated, bf16): its weights plus a KV cache of ``2 * layers * kv_heads * head_dim * 2``
  bytes per token, inside ``--vllm-memory-fraction`` of the GPU;
* step time: learner FLOPs ``6 P`` per trained token (+ ``2 P`` per forward without gradient: recomputed old
  log-probs, the KL reference, checkpointing) at the learner throughput measured in docs/results/gpu-h100.md#learner;
  decoding as
  memory-bound (weights + KV read per step) at a spec bandwidth times an assumed efficiency. Tool time, ZeRO
  communication, weight sync and prefill are not modelled.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

#: Inputs, each with its source. "measured": on one H100 80GB (the GPU notes' learner and decode tables).
INPUTS: dict[str, tuple[float, str]] = {
    "matmul_ceiling_tflops": (773.0, "measured: bf16 8192x8192 GEMM, H100 80GB (docs/results/gpu-h100.md#learner)"),
    "learner_tflops_bf16": (
        170.0,
        "measured: 1.5B shape, bf16 autocast, forward+backward, 22% MFU (docs/results/gpu-h100.md#learner)",
    ),
    "learner_tflops_fp32": (
        41.0,
        "measured: 1.5B shape, fp32, forward+backward, 5% MFU (docs/results/gpu-h100.md#learner)",
    ),
    "gpu_memory_gb": (80.0, "the GPU of docs/results/gpu-h100.md (H100 80GB); override with --gpu-memory-gb"),
    "hbm_tb_per_s": (3.35, "spec, NOT measured: H100 SXM HBM3 bandwidth from NVIDIA's data sheet"),
    "decode_bandwidth_efficiency": (0.6, "assumption, NOT measured: share of HBM bandwidth a vLLM decode step uses"),
}
#: docs/results/gpu-h100.md#learner table, bf16 autocast rows: (layers, hidden, vocab, peak GB duplicated, peak GB
#: deduplicated).
#: bench_dedup used one micro-batch per group: 10,280 / 4 = 2,570 tokens duplicated, 3,713 / 4 = 928 deduplicated.
MEASURED_PEAKS = {"SmolLM2-135M": (30, 576, 49152, 5.8, 3.3), "1.5B shape": (28, 1536, 151936, 24.0, 17.4)}
MICRO_TOKENS_DUP, MICRO_TOKENS_DEDUP = 10280 / 4, 3713 / 4

#: Public architecture figures (each model's config.json), used when [model] path is not a local folder.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen2.5-7B-Instruct": {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "model_type": "qwen2",
    },
    "Qwen3-8B": {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "model_type": "qwen3",
    },
}
GB = 1e9


def activation_fit() -> tuple[float, float]:
    """(a, b) of ``bytes/token = a * layers * hidden + b * vocab``, solved from the two measured bf16 shapes."""
    rows = []
    for layers, hidden, vocab, dup, dedup in MEASURED_PEAKS.values():
        per_token = (dup - dedup) * GB / (MICRO_TOKENS_DUP - MICRO_TOKENS_DEDUP)
        rows.append((layers * hidden, vocab, per_token))
    (x1, y1, z1), (x2, y2, z2) = rows
    det = x1 * y2 - x2 * y1
    return (z1 * y2 - z2 * y1) / det, (x1 * z2 - x2 * z1) / det


def architecture(model_path: str) -> tuple[str, dict[str, Any]]:
    """The model's config: a local folder's config.json, else the built-in figures for a known model name."""
    p = Path(model_path).expanduser()
    if (p / "config.json").is_file():
        return str(p / "config.json"), json.loads((p / "config.json").read_text())
    if p.name in KNOWN_MODELS:
        return f"built-in figures for {p.name} (its public config.json)", KNOWN_MODELS[p.name]
    from arpo_base.errors import ConfigError

    raise ConfigError(
        f"no architecture for model {model_path!r}: not a folder with config.json, not one of {sorted(KNOWN_MODELS)}",
        hint="pass --set model.path=<local HF folder>",
    )


def parameters(c: dict[str, Any]) -> int:
    """Parameter count of a Llama-family decoder (Llama, Qwen2 with its q/k/v biases, Qwen3 with its q/k norms)."""
    h, L, V, inter = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    bias = c.get("attention_bias", c.get("model_type") == "qwen2")
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if bias else 0)
    qk_norm = 2 * hd if c.get("model_type") == "qwen3" else 0
    layer = attn + qk_norm + 3 * h * inter + 2 * h
    return V * h * (1 if c.get("tie_word_embeddings") else 2) + L * layer + h


def estimate(
    recipe: str,
    *,
    gpus: int,
    zero: int,
    gpu_memory_gb: float | None = None,
    response_fill: float = 0.5,
    vllm_memory_fraction: float = 0.5,
    prompt_tokens: int = 1024,
    model_path: str | None = None,
) -> dict[str, Any]:
    """Per-GPU memory (GB) and step time (s) of ``recipe`` (``model_path`` replaces its [model] path); see the
    module docstring for the model."""
    from arpo_algo.run.experiment import load_experiment

    exp = load_experiment(recipe, [f"model.path={json.dumps(model_path)}"] if model_path else None)
    s = exp.config.settings
    cfg, tree, rollouts = s.training, s.tree, s.rollouts
    source, arch = architecture(s.model.path)
    P = parameters(arch)
    L, h, V = arch["num_hidden_layers"], arch["hidden_size"], arch["vocab_size"]
    hd = arch.get("head_dim") or h // arch["num_attention_heads"]
    mem_gb = gpu_memory_gb or INPUTS["gpu_memory_gb"][0]
    bf16 = cfg.precision in ("bf16", "auto")  # "auto" is bf16 on the GPUs these recipes target
    checkpointing = bool(cfg.gradient_checkpointing)

    # --- learner memory per GPU
    shard = {0: (1, 1, 1), 1: (1, 1, gpus), 2: (1, gpus, gpus), 3: (gpus, gpus, gpus)}[zero]
    weights, grads, adam = 4 * P / shard[0], 4 * P / shard[1], 8 * P / shard[2]
    a, b = activation_fit()
    full_layer = a * h  # bytes per token of one layer's activations (bf16 autocast fit)
    per_token = (4 * L * h + full_layer + b * V) if checkpointing else (a * L * h + b * V)
    activations = per_token * cfg.micro_batch_tokens
    ref = 2 * P / gpus if cfg.kl_coef > 0 else 0.0  # a bf16 reference copy, sharded like ZeRO-3 (assumption)
    learner = weights + grads + adam + activations + ref

    # --- rollout engine (colocated vLLM): weights + KV cache within its memory fraction
    kv_per_token = 2 * L * arch["num_key_value_heads"] * hd * 2
    engine_weights = 2 * P
    kv_budget = max(vllm_memory_fraction * mem_gb * GB - engine_weights, 0.0)
    seq_len = prompt_tokens + rollouts.max_response_tokens
    fit_seqs = int(kv_budget // (kv_per_token * seq_len))
    trajectories = cfg.prompts_per_step * tree.budget
    per_engine = math.ceil(trajectories / gpus)

    # --- step time
    response = rollouts.max_response_tokens * response_fill
    trained = cfg.prompts_per_step * (prompt_tokens + tree.budget * response)  # prompt once per group (dedup)
    passes = 6 + 2 * (cfg.old_logprobs == "recompute") + 2 * (cfg.kl_coef > 0) + 2 * checkpointing
    learner_tflops = INPUTS["learner_tflops_bf16" if bf16 else "learner_tflops_fp32"][0]
    learner_s = passes * P * trained / (learner_tflops * 1e12 * gpus)
    batch = max(min(fit_seqs, per_engine), 1)
    rounds = math.ceil(per_engine / batch)
    bw = INPUTS["hbm_tb_per_s"][0] * 1e12 * INPUTS["decode_bandwidth_efficiency"][0]
    mean_ctx = prompt_tokens + response / 2
    decode_step_s = (engine_weights + batch * mean_ctx * kv_per_token) / bw
    rollout_s = rounds * response * decode_step_s

    return {
        "recipe": str(exp.source),
        "model": s.model.path,
        "architecture_source": source,
        "parameters_billion": P / 1e9,
        "gpus": gpus,
        "zero_stage": zero,
        "gpu_memory_gb": mem_gb,
        "precision": "bf16 autocast, fp32 master weights" if bf16 else "fp32",
        "gradient_checkpointing": checkpointing,
        "assumptions": {
            "response_fill": response_fill,
            "prompt_tokens": prompt_tokens,
            "vllm_memory_fraction": vllm_memory_fraction,
        },
        "memory_gb_per_gpu": {
            "weights_fp32": weights / GB,
            "grads_fp32": grads / GB,
            "adam_fp32": adam / GB,
            "activations": activations / GB,
            "kl_reference": ref / GB,
            "learner_total": learner / GB,
            "vllm_weights_bf16": engine_weights / GB,
            "vllm_kv_budget": kv_budget / GB,
            "colocated_total_engine_awake": learner / GB + vllm_memory_fraction * mem_gb,
            "colocated_total_engine_asleep": learner / GB + engine_weights / GB,
        },
        "fits": {
            "learner_alone": learner / GB <= mem_gb,
            "colocated_engine_awake": learner / GB + vllm_memory_fraction * mem_gb <= mem_gb,
        },
        "activation_fit_bytes_per_token": {"a_per_layer_hidden": a, "b_per_vocab": b, "per_token": per_token},
        "kv_bytes_per_token": kv_per_token,
        "sequences_in_kv_per_engine": fit_seqs,
        "trajectories_per_step": trajectories,
        "trained_tokens_per_step": trained,
        "step_time_s": {"rollout_decode": rollout_s, "learner": learner_s, "total": rollout_s + learner_s},
        "inputs": {k: {"value": v, "source": s} for k, (v, s) in INPUTS.items()},
    }


def _print(r: dict[str, Any]) -> None:
    print(f"ESTIMATE (not a measurement) for {r['recipe']}")
    print(f"  model {r['model']}: {r['parameters_billion']:.2f}B parameters ({r['architecture_source']})")
    print(
        f"  {r['gpus']} GPU(s) of {r['gpu_memory_gb']:.0f} GB, ZeRO stage {r['zero_stage']}, {r['precision']}, "
        f"gradient checkpointing {r['gradient_checkpointing']}; assumptions {r['assumptions']}"
    )
    print("  memory per GPU (GB):")
    for k, v in r["memory_gb_per_gpu"].items():
        print(f"    {k:<32} {v:9.1f}")
    print(f"  fits: {r['fits']}")
    print(
        f"  KV cache: {r['kv_bytes_per_token'] / 1024:.0f} KiB/token, {r['sequences_in_kv_per_engine']} full-length "
        f"sequences per engine; {r['trajectories_per_step']} trajectories, "
        f"{r['trained_tokens_per_step'] / 1e6:.2f}M trained tokens per step"
    )
    t = r["step_time_s"]
    print(
        f"  step time (s): rollout decode {t['rollout_decode']:.0f}, learner {t['learner']:.0f}, "
        f"total {t['total']:.0f} (tool calls, prefill, ZeRO communication and weight sync not included)"
    )
    print("  inputs:")
    for k, v in r["inputs"].items():
        print(f"    {k} = {v['value']}  [{v['source']}]")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m arpo_algo.run.estimate_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="experiment name or TOML path (e.g. gpu_reasoning_qwen25_7b)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs the learner is sharded over (reference: 8)")
    ap.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=3, help="DeepSpeed ZeRO stage (0 = none)")
    ap.add_argument("--gpu-memory-gb", type=float, default=None, help="memory of one GPU (default 80, H100)")
    ap.add_argument(
        "--response-fill",
        type=float,
        default=0.5,
        help="assumed mean response length as a share of max_response_tokens",
    )
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="assumed prompt length")
    ap.add_argument(
        "--vllm-memory-fraction",
        type=float,
        default=0.5,
        help="share of a GPU the colocated vLLM engine may take (VLLMEngine default 0.5)",
    )
    ap.add_argument("--model", default=None, help="a local HF folder replacing the recipe's [model] path")
    ap.add_argument("--json", type=Path, default=None, help="also write the estimate here")
    args = ap.parse_args(argv)
    if args.gpus < 1:
        ap.error(f"--gpus must be >= 1, got {args.gpus}")
    if not 0 < args.response_fill <= 1 or not 0 < args.vllm_memory_fraction < 1:
        ap.error("--response-fill must be in (0, 1] and --vllm-memory-fraction in (0, 1)")
    r = estimate(
        args.recipe,
        gpus=args.gpus,
        zero=args.zero,
        gpu_memory_gb=args.gpu_memory_gb,
        response_fill=args.response_fill,
        vllm_memory_fraction=args.vllm_memory_fraction,
        prompt_tokens=args.prompt_tokens,
        model_path=args.model,
    )
    _print(r)
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main()
