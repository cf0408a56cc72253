"""Random branched rollout groups of a chosen shape, for benchmarks and tests of the learner's tree batching.

The token ids are random (no model produced them); the shape is an ARPO tree's: a shared prompt and prefix (with a
tool result masked out inside the prefix), ``width`` branches after it, ``children`` leaves under each.
"""

from __future__ import annotations

import random

from arpo_algo.rollout.types import Group, Trajectory


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
