"""Benchmark: prefix-deduplicated training vs the duplicated computation on branched groups.

    python -m benchmarks.bench_dedup --model smollm2-135m-instruct --out results.json
    python -m benchmarks.bench_dedup --shape 1.5b --device cuda --precision bf16 --tree-attention flex --groups 4

Each group is a synthetic ARPO-shaped tree of M=8 trajectories built from random token ids: a 120-token prompt plus
an 80-token shared response prefix (with a masked 20-token tool result inside), 4 depth-1 branches and 2 depth-2
children under each (40–80 tokens per branch). For each group both paths run forward + backward of the same loss
(dual-clip PPO, token mean) with the same weights, precision and thread count, alternating, and the median time per
group is reported with the speed-up and the max abs difference of the parameter gradients.

The model is ``--model`` (a registered name or HF folder), or with ``--shape`` a randomly initialised Llama of a
named size (``1.5b``: Qwen2.5-1.5B's dimensions and vocabulary, 1.54B parameters; ``tiny``: 2 layers of width 64),
built in a temporary folder with the repo's byte tokenizer, so a GPU machine needs no download.

**MFU.** The same run times a large square matmul in the compute dtype on the same device (``--ceiling-size``; 8192
on CUDA) and reports each path's model FLOP rate, ``6 · parameters · tokens through the model / time`` (attention
scores not counted), as a fraction of that ceiling. On CUDA it also reports the memory each step adds on top of what
was allocated before it (both learners' weights).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from arpo_algo.core.losses import dual_clip_policy_loss
from arpo_algo.rollout.synthetic import make_group
from arpo_algo.rollout.types import Group
from arpo_algo.train.device_setup import PRECISIONS, TREE_ATTENTIONS
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_algo.train.tree_forward import forward_token_stats

SHAPES = {
    # Qwen2.5-1.5B's dimensions as a Llama (no attention biases): 1.54B parameters with the tied embedding.
    "1.5b": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 4096,
    },
}


def build_shape(shape: str, dest: Path, seed: int = 0) -> Path:
    """A randomly initialised Llama of a named size with the byte tokenizer (token ids beyond it are fine here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from arpo_algo.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    cfg = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_ceiling(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """TFLOP/s of an n x n x n matmul in ``dtype`` on ``device`` (best of ``repeats`` after a warm-up)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def fwd_bwd(learner: Learner, groups: list[Group]) -> tuple[float, dict[str, float]]:
    """Forward + backward of the training loss (no optimizer step); returns (seconds, sizes and peak memory)."""
    learner.model.zero_grad(set_to_none=True)
    dev = learner.device
    _sync(dev)
    if dev.type == "cuda":
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    batches, norms = learner.prepare_batches(groups)
    for b, w in zip(batches, norms):
        with learner.autocast():
            lp_u, _ = forward_token_stats(learner.model, b, with_entropy=True, entropy_grad=False)
        lp = lp_u[b.pair_node]
        out = dual_clip_policy_loss(lp, b.pair_old_logp, b.pair_adv)
        (w * out.loss).sum().backward()
    _sync(dev)
    seconds = time.perf_counter() - t0
    sizes = {"tokens_through_model": sum(b.num_tokens for b in batches)}
    if dev.type == "cuda":
        sizes["step_memory_gb"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**30
    return seconds, sizes


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default=None, help="a random-init model of this size instead of --model"
    )
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when available")
    ap.add_argument("--precision", choices=list(PRECISIONS), default="auto", help="LearnerConfig.precision")
    ap.add_argument(
        "--tree-attention", choices=list(TREE_ATTENTIONS), default="auto", help="LearnerConfig.tree_attention"
    )
    ap.add_argument("--groups", type=int, default=2, help="groups measured (one group per micro-batch)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per path per group (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ceiling-size", type=int, default=None, help="matmul size for the ceiling (8192 CUDA, 1024 CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="bench-dedup-") as tmp:
        model = build_shape(args.shape, Path(tmp) / "model") if args.shape else args.model
        return _run(args, model, device)


def _run(args: argparse.Namespace, model: str | Path, device: str) -> dict:
    cfg = LearnerConfig(
        old_logprobs="rollout",
        micro_batch_tokens=1,  # 1 token: every group is its own micro-batch
        precision=args.precision,
        tree_attention=args.tree_attention,
    )
    dup = Learner(model, replace(cfg, dedup_prefix=False), device=device)
    ded = Learner(model, replace(cfg, dedup_prefix=True), device=device)
    dup.model.train()
    ded.model.train()
    rng = random.Random(0)
    vocab = dup.vocab_size
    groups = [make_group(rng, vocab, i) for i in range(args.groups)]
    times = {"duplicated": [], "deduplicated": []}
    sizes = {}
    memory = {"duplicated": 0.0, "deduplicated": 0.0}
    max_diff = 0.0
    max_grad = 0.0
    for g in groups:
        fwd_bwd(dup, [g])  # warm-up (allocator, kernels, FlexAttention compile)
        fwd_bwd(ded, [g])
        for _ in range(args.repeats):
            for name, learner in (("duplicated", dup), ("deduplicated", ded)):
                t, sizes[name] = fwd_bwd(learner, [g])
                times[name].append(t)
                memory[name] = max(memory[name], sizes[name].get("step_memory_gb", 0.0))
        for (_, p), (_, q) in zip(dup.model.named_parameters(), ded.model.named_parameters()):
            if p.grad is not None:
                max_diff = max(max_diff, float((p.grad - q.grad).abs().max()))
                max_grad = max(max_grad, float(p.grad.abs().max()))
    med = {k: statistics.median(v) for k, v in times.items()}
    dev = torch.device(device)
    n = args.ceiling_size or (8192 if dev.type == "cuda" else 1024)
    dtype = torch.bfloat16 if ded.precision == "bf16" else torch.float32
    ceiling = matmul_ceiling(dev, dtype, n)
    params = sum(p.numel() for p in ded.model.parameters())
    tokens = {k: v["tokens_through_model"] for k, v in sizes.items()}
    tflops = {k: 6 * params * tokens[k] / med[k] / 1e12 for k in med}
    result = {
        "model": str(args.shape or args.model),
        "parameters": params,
        "device": device,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "precision": ded.precision,
        "tree_attention": ded.tree_attention,
        "threads": args.threads,
        "groups": args.groups,
        "repeats": args.repeats,
        "trajectories_per_group": len(groups[0].trajectories),
        "tokens_per_group": tokens,
        "seconds_per_group_median": med,
        "speedup": med["duplicated"] / med["deduplicated"],
        "model_tflops": tflops,
        "matmul_ceiling": {
            "tflops": ceiling,
            "size": n,
            "dtype": str(dtype).replace("torch.", ""),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        },
        "mfu": {k: v / ceiling for k, v in tflops.items()},
        "grad_max_abs_diff": max_diff,
        "grad_max_abs": max_grad,
        "torch": torch.__version__,
        "attn_implementation": cfg.attn_implementation,
    }
    if dev.type == "cuda":
        result["step_memory_gb"] = memory
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
