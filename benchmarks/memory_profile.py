"""Where the quickstart's memory goes: peak resident memory after each part of one training step.

    python -m benchmarks.memory_profile [--model smollm2-135m-instruct] [--prompts N] [--budget M] [--tokens T]
                                         [--micro-batch-tokens N] [--release-before-update]
                                         [--gradient-checkpointing | --no-gradient-checkpointing]
    python -m benchmarks.memory_profile --stage sft [--batch-size 8] [--grad-accum 1] [--rows-per-forward N]
                                         [--gradient-checkpointing | --no-gradient-checkpointing]

``--stage sft``: the quickstart's SFT settings (``arpo_algo.run.quickstart.SFT_SETTINGS``, with the flags above in
place of its own), on its worst step: the ``batch_size x grad_accum`` longest demonstrations in one optimizer step
(the widest padded batches; two steps on them, the second with the AdamW state already there), and the first loss
and gradient norm, so that settings which must give the same update can be compared.

``--stage rl`` (default): the quickstart's RL settings (``arpo_algo/run/recipes/quickstart.toml``: prompts per step,
tree budget, response tokens, ``micro_batch_tokens``, ``gradient_checkpointing``, learning rate, the engine's batch
size) unless a flag sets one.

Loads the learner (model + AdamW), builds an HFEngine on the learner's module (as the Algorithm does), then runs two
training steps as the Algorithm's synchronous loop does: each generates one step's worth of trajectories (prompts x
budget random-context requests of ``--tokens`` new tokens, sampled) under the current weights and runs one learner
update on them as GRPO groups with a reward spread. The second step has the AdamW state already there. Each update
trains on a batch its own weights sampled: updating twice on one batch would score the second update's batch under
weights that did not sample it, which the learner's mismatch alarm stops (a stale batch needs ``behaviour_weights``,
as the asynchronous pipeline passes). Prints the process's peak RSS (``ru_maxrss``) after each part; the difference
between two lines is what that part added at its peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any


def quickstart_rl() -> dict[str, Any]:
    """The quickstart RL recipe's settings this stage uses (read from the recipe, so the two cannot drift apart)."""
    from arpo_algo.run.quickstart import RECIPES
    from arpo_base.options import read_toml

    r = read_toml(RECIPES / "quickstart.toml")
    t = r["training"]
    return {
        "prompts": t["prompts_per_step"],
        "budget": r["tree"]["budget"],
        "tokens": r["rollouts"]["max_response_tokens"],
        "micro_batch_tokens": t["micro_batch_tokens"],
        "gradient_checkpointing": t["gradient_checkpointing"],
        "lr": t["lr"],
        "max_batch_size": r["rollouts"]["hf"]["max_batch_size"],
    }


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=None, help="rl: prompts per step (default: the quickstart's)")
    ap.add_argument("--budget", type=int, default=None, help="rl: trajectories per prompt (default: the quickstart's)")
    ap.add_argument(
        "--tokens", type=int, default=None, help="rl: new tokens per trajectory (default: the quickstart's)"
    )
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument(
        "--micro-batch-tokens", type=int, default=None, help="rl: learner micro-batch (default: the quickstart's)"
    )
    ap.add_argument("--head-chunk-tokens", type=int, default=None, help="rl: LM head over this many tokens at a time")
    ap.add_argument(
        "--release-before-update",
        action="store_true",
        help="rl: gc + malloc_trim (arpo_algo.run.quickstart.release_memory) before each update",
    )
    ap.add_argument(
        "--keep-engine-caches",
        action="store_true",
        help="rl: keep the engine's transposed weight copies during the update (before engine.sleep())",
    )
    ap.add_argument("--stage", choices=("rl", "sft"), default="rl")
    ap.add_argument("--batch-size", type=int, default=None, help="sft: sequences per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=None, help="sft: micro-batches per optimizer step")
    ap.add_argument("--rows-per-forward", type=int, default=None, help="sft: rows per forward/backward pass")
    ap.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="activation checkpointing on or off (both stages; default: the quickstart's)",
    )
    args = ap.parse_args(argv)
    if args.stage == "sft":
        return profile_sft(args)
    return profile_rl(args)


def profile_rl(args: argparse.Namespace) -> int:
    import random

    import torch

    from arpo_algo.rollout import learner_metrics as LK
    from arpo_algo.rollout.engines.hf.engine import HFEngine
    from arpo_algo.train.learner import Learner, LearnerConfig

    recipe = quickstart_rl()
    for k, v in recipe.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    rows = [("start (python + torch + transformers imported)", peak_gb())]
    t0 = time.time()
    learner = Learner(
        args.model,
        LearnerConfig(
            lr=recipe["lr"],
            micro_batch_tokens=args.micro_batch_tokens,
            gradient_checkpointing=bool(args.gradient_checkpointing),
            head_chunk_tokens=args.head_chunk_tokens,
        ),
        seed=0,
    )
    rows.append(("learner loaded (fp32 weights + AdamW, no state yet)", peak_gb()))
    engine = HFEngine(model=learner.model, tokenizer=learner.tokenizer, max_batch_size=recipe["max_batch_size"])
    rows.append(("HFEngine on the learner's module (transposed weight copies on CPU)", peak_gb()))
    rng = random.Random(0)
    vocab = learner.tokenizer.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    from arpo_algo.run.quickstart import release_memory

    release = release_memory if args.release_before_update else (lambda: False)
    metrics = []
    for step, label in enumerate(
        ("one learner update (forward with entropy, backward, AdamW state created)", "a second update")
    ):
        groups = sample_step(engine, prompts, args, step)
        if step == 0:
            rows.append(
                (f"generated {args.prompts * args.budget} x {args.tokens} tokens (KV cache kept for reuse)", peak_gb())
            )
        if args.keep_engine_caches:  # before the change: only the stored KV went (the sampler releases its keys)
            engine._store.clear()
        else:  # as the Algorithm does before an update: KV store and transposed weight copies
            engine.sleep()
        release()
        metrics.append(learner.update(groups))
        rows.append((label if step == 0 else f"{label} (on a batch sampled anew under the updated weights)", peak_gb()))
    m, m2 = metrics
    for name, gb in rows:
        print(f"{gb:6.2f} GB  {name}")
    print(
        json.dumps(
            {
                "peak_gb": rows[-1][1],
                "unique_tokens": m[LK.UNIQUE_TOKENS],
                "time_s": time.time() - t0,
                "param_change_norm": m2[LK.PARAM_CHANGE_NORM],
                "kl_rollout": [m[LK.KL_ROLLOUT], m2[LK.KL_ROLLOUT]],
                "torch_threads": torch.get_num_threads(),
                "settings": {k: getattr(args, k) for k in recipe if k not in ("lr", "max_batch_size")},
            }
        )
    )
    return 0


def sample_step(engine: Any, prompts: list[list[int]], args: argparse.Namespace, step: int) -> list[Any]:
    """One step's GRPO groups, sampled by ``engine`` under the weights it holds now (``step`` varies the seeds, as a
    new iteration's draws differ)."""
    from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
    from arpo_algo.rollout.types import Group, Trajectory

    reqs = [
        GenRequest((i, j), prompts[i], SamplingParams(max_new_tokens=args.tokens, seed=(step * 1000 + i) * 100 + j))
        for i in range(len(prompts))
        for j in range(args.budget)
    ]
    gens = engine.generate(reqs)
    groups = []
    for i in range(len(prompts)):
        trajs = []
        for j in range(args.budget):
            g = gens[i * args.budget + j]
            n = len(g.token_ids)
            trajs.append(Trajectory(j, g.token_ids, [1] * n, g.logprobs, g.entropies, reward=float(j % 2)))
        groups.append(Group(i, prompts[i], trajs))
    return groups


def profile_sft(args: argparse.Namespace) -> int:
    import torch

    from arpo_algo.run.quickstart import SFT_SETTINGS
    from arpo_algo.train.optim import build_optimizer
    from arpo_algo.train.sft import SFTConfig, _load_model, _train_step
    from arpo_algo.train.sft_data import build_dataset, load_examples

    rows = [("start (python + torch + transformers imported)", peak_gb())]
    t0 = time.time()
    flags = {
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "rows_per_forward": args.rows_per_forward,
        "gradient_checkpointing": args.gradient_checkpointing,
    }
    settings = {**SFT_SETTINGS, **{k: v for k, v in flags.items() if v is not None}}
    cfg = SFTConfig(model=args.model, progress=False, tensorboard=False, **settings)
    cfg.validate()
    torch.manual_seed(cfg.seed)
    model, tokenizer, device = _load_model(cfg)
    data, _ = build_dataset(tokenizer, load_examples(cfg), cfg.max_seq_len, cfg.truncation)
    opt, _ = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, schedule="constant")
    rows.append(("model loaded, AdamW built (no state yet)", peak_gb()))
    longest = sorted(data, key=lambda r: len(r[0]), reverse=True)[: cfg.batch_size * cfg.grad_accum]
    micro = [longest[k : k + cfg.batch_size] for k in range(0, len(longest), cfg.batch_size)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.train()
    first: dict[str, float] = {}
    for step in (1, 2):
        loss, n_tok = _train_step(model, micro, pad, device, cfg.bf16, cfg.rows_per_forward)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        first = first or {"loss": loss, "grad_norm": grad_norm, "tokens": n_tok}
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows.append(
            (
                f"SFT step {step} on the {len(longest)} longest rows (up to {max(len(r[0]) for r in longest)} tokens)",
                peak_gb(),
            )
        )
    for name, gb in rows:
        print(f"{gb:6.2f} GB  {name}")
    print(
        json.dumps(
            {
                "peak_gb": rows[-1][1],
                "first_step": first,
                "time_s": round(time.time() - t0, 1),
                "settings": {k: getattr(cfg, k) for k in ("batch_size", "grad_accum", "max_seq_len")}
                | {"rows_per_forward": cfg.rows_per_forward, "gradient_checkpointing": cfg.gradient_checkpointing},
                "torch_threads": torch.get_num_threads(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
