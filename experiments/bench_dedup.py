"""Benchmark: prefix-deduplicated training vs the duplicated computation on branched groups.

    python -m experiments.bench_dedup --model smollm2-135m-instruct --out results.json

Each group is a synthetic ARPO-shaped tree of M=8 trajectories built from random SmolLM2 token ids: a 120-token
prompt plus an 80-token shared response prefix (with a masked 20-token tool result inside), 4 depth-1 branches and
2 depth-2 children under each (40–80 tokens per branch). For each group both paths run forward + backward of the
same loss (dual-clip PPO, token mean) with the same weights and thread count, alternating, and the median time per
group is reported with the speed-up and the max abs difference of the parameter gradients.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from arpo_algo.core.losses import dual_clip_policy_loss
from arpo_algo.rollout.types import Group, Trajectory
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_algo.train.tree_forward import forward_token_stats


def make_group(rng: random.Random, vocab: int, index: int, *, prompt_len: int = 120, prefix_len: int = 80,
               width: int = 4, children: int = 2, branch: tuple[int, int] = (40, 80)) -> Group:
    """One branched tree: shared prompt + prefix, ``width`` depth-1 branches, ``children`` leaves under each."""
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    prompt = ids(prompt_len)
    prefix = ids(prefix_len)
    prefix_mask = [1] * prefix_len
    tool = slice(prefix_len * 3 // 8, prefix_len * 5 // 8)  # a tool result inside the shared prefix (30:50 of 80)
    prefix_mask[tool] = [0] * len(range(prefix_len)[tool])
    trajs = []
    for _ in range(width):
        b1 = ids(rng.randint(*branch))
        for _ in range(children):
            b2 = ids(rng.randint(*branch))
            resp = prefix + b1 + b2
            mask = prefix_mask + [1] * (len(b1) + len(b2))
            old = [-2.0 - 0.01 * (t % 7) if m else 0.0 for t, m in enumerate(mask)]
            trajs.append(Trajectory(traj_id=len(trajs), response_ids=resp, trained_mask=mask, old_logprobs=old,
                                    entropies=[0.0] * len(resp), reward=float(rng.random() < 0.5)))
    return Group(prompt_index=index, prompt_ids=prompt, trajectories=trajs)


def fwd_bwd(learner: Learner, groups: list[Group]) -> tuple[float, dict[str, float]]:
    """Forward + backward of the training loss (no optimizer step); returns (seconds, sizes)."""
    learner.model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    batches, norms = learner.prepare_batches(groups)
    for b, w in zip(batches, norms):
        lp_u, _ = forward_token_stats(learner.model, b, with_entropy=True, entropy_grad=False)
        lp = lp_u[b.pair_node]
        out = dual_clip_policy_loss(lp, b.pair_old_logp, b.pair_adv)
        (w * out.loss).sum().backward()
    seconds = time.perf_counter() - t0
    return seconds, {"tokens_through_model": sum(b.num_tokens for b in batches)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--groups", type=int, default=2, help="groups measured (one group per micro-batch)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per path per group (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = LearnerConfig(old_logprobs="rollout", micro_batch_tokens=1)  # 1 token: every group is its own micro-batch
    dup = Learner(args.model, replace(cfg, dedup_prefix=False))
    ded = Learner(args.model, replace(cfg, dedup_prefix=True))
    dup.model.train()
    ded.model.train()
    rng = random.Random(0)
    vocab = dup.vocab_size
    groups = [make_group(rng, vocab, i) for i in range(args.groups)]
    times = {"duplicated": [], "deduplicated": []}
    sizes = {}
    max_diff = 0.0
    max_grad = 0.0
    for g in groups:
        fwd_bwd(dup, [g])  # warm-up (allocator, kernels)
        fwd_bwd(ded, [g])
        for _ in range(args.repeats):
            t, sizes["duplicated"] = fwd_bwd(dup, [g])
            times["duplicated"].append(t)
            t, sizes["deduplicated"] = fwd_bwd(ded, [g])
            times["deduplicated"].append(t)
        for (_, p), (_, q) in zip(dup.model.named_parameters(), ded.model.named_parameters()):
            if p.grad is not None:
                max_diff = max(max_diff, float((p.grad - q.grad).abs().max()))
                max_grad = max(max_grad, float(p.grad.abs().max()))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": args.model, "threads": args.threads, "groups": args.groups, "repeats": args.repeats,
        "trajectories_per_group": len(groups[0].trajectories),
        "tokens_per_group": {k: v["tokens_through_model"] for k, v in sizes.items()},
        "seconds_per_group_median": med,
        "speedup": med["duplicated"] / med["deduplicated"],
        "grad_max_abs_diff": max_diff, "grad_max_abs": max_grad,
        "torch": torch.__version__, "attn_implementation": cfg.attn_implementation,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
