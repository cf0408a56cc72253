"""Where the RL stage's memory goes (issue 10): peak resident memory after each part of one quickstart-sized step.

    python -m experiments.memory_profile [--model smollm2-135m-instruct] [--prompts 4] [--budget 4] [--tokens 192]

Loads the learner (model + AdamW), builds an HFEngine on the learner's module (as the Algorithm does), generates one
step's worth of trajectories (prompts x budget random-context requests of ``--tokens`` new tokens, sampled), then
runs one learner update on them as GRPO groups with a reward spread. Prints the process's peak RSS (``ru_maxrss``)
after each part; the difference between two lines is what that part added at its peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

LEARNER_DEFAULT_MICRO_BATCH = 8192  # LearnerConfig.micro_batch_tokens


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--micro-batch-tokens", type=int, default=LEARNER_DEFAULT_MICRO_BATCH)
    args = ap.parse_args(argv)
    import random

    import torch

    from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
    from arpo_algo.rollout.engines.hf import HFEngine
    from arpo_algo.rollout.types import Group, Trajectory
    from arpo_algo.train.learner import Learner, LearnerConfig

    rows = [("start (python + torch + transformers imported)", peak_gb())]
    t0 = time.time()
    learner = Learner(args.model, LearnerConfig(lr=5e-5, micro_batch_tokens=args.micro_batch_tokens), seed=0)
    rows.append(("learner loaded (fp32 weights + AdamW, no state yet)", peak_gb()))
    engine = HFEngine(model=learner.model, tokenizer=learner.tokenizer, max_batch_size=16)
    rows.append(("HFEngine on the learner's module (transposed weight copies on CPU)", peak_gb()))
    rng = random.Random(0)
    vocab = learner.tokenizer.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    reqs = [GenRequest((i, j), prompts[i], SamplingParams(max_new_tokens=args.tokens, seed=i * 100 + j))
            for i in range(args.prompts) for j in range(args.budget)]
    gens = engine.generate(reqs)
    rows.append((f"generated {len(reqs)} x {args.tokens} tokens (KV cache kept for reuse)", peak_gb()))
    groups = []
    for i in range(args.prompts):
        trajs = []
        for j in range(args.budget):
            g = gens[i * args.budget + j]
            n = len(g.token_ids)
            trajs.append(Trajectory(j, g.token_ids, [1] * n, g.logprobs, g.entropies, reward=float(j % 2)))
        groups.append(Group(i, prompts[i], trajs))
    engine.release(list(engine._store))  # the sampler releases every key at the end of a step
    m = learner.update(groups)
    rows.append(("one learner update (forward with entropy, backward, AdamW state created)", peak_gb()))
    m2 = learner.update(groups)
    rows.append(("a second update", peak_gb()))
    for name, gb in rows:
        print(f"{gb:6.2f} GB  {name}")
    print(json.dumps({"peak_gb": rows[-1][1], "unique_tokens": m["unique_tokens"], "time_s": time.time() - t0,
                      "param_change_norm": m2["param_change_norm"],
                      "torch_threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
