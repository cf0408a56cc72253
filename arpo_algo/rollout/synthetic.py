"""Synthetic rollout groups, for benchmarks and tests of the learner.

:func:`make_group`: random token ids in an ARPO tree's shape (a shared prompt and prefix with a tool result masked out
inside it, ``width`` branches after it, ``children`` leaves under each). :func:`clean_groups`: groups whose sampled
log-probs are the model's own, and :func:`plant_tool_first_token` / :func:`plant_kv_reuse`, the same groups with a
known sampler fault planted, for checking what the mismatch alarm sees.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import torch

from arpo_algo.rollout.types import Group, Trajectory


def make_group(
    rng: random.Random,
    vocab: int,
    index: int,
    *,
    prompt_len: int = 120,
    prefix_len: int = 80,
    width: int = 4,
    children: int = 2,
    branch: tuple[int, int] = (40, 80),
) -> Group:
    """One branched tree: shared prompt + prefix, ``width`` depth-1 branches, ``children`` leaves under each."""
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    prompt = ids(prompt_len)
    prefix = ids(prefix_len)
    prefix_mask = [1] * prefix_len
    tool = slice(prefix_len * 3 // 8, prefix_len * 5 // 8)  # a tool result inside the shared prefix (30:50 of 80)
    prefix_mask[tool] = [0] * len(range(prefix_len)[tool])
    trajs: list[Trajectory] = []
    for _ in range(width):
        b1 = ids(rng.randint(*branch))
        for _ in range(children):
            b2 = ids(rng.randint(*branch))
            resp = prefix + b1 + b2
            mask = prefix_mask + [1] * (len(b1) + len(b2))
            old = [-2.0 - 0.01 * (t % 7) if m else 0.0 for t, m in enumerate(mask)]
            trajs.append(
                Trajectory(
                    traj_id=len(trajs),
                    response_ids=resp,
                    trained_mask=mask,
                    old_logprobs=old,
                    entropies=[0.0] * len(resp),
                    reward=float(rng.random() < 0.5),
                )
            )
    return Group(prompt_index=index, prompt_ids=prompt, trajectories=trajs)


#: Sampled tokens per segment; a tool result follows each segment but the last, so with SEGMENTS = 5 the first token
#: after a tool result is 4 of 400 sampled tokens (1%).
SEGMENT, SEGMENTS, TOOL_TOKENS = 80, 5, 6


@torch.no_grad()
def _logprobs(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """The model's log-prob of every response token given everything before it (eval mode, float32)."""
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def clean_groups(model: Any, *, seed: int, num_groups: int = 4, branches: int = 3) -> list[Group]:
    """Tool-using trees with the model's own log-probs: per group a root trajectory of SEGMENTS sampled segments with
    a tool result after each but the last, and ``branches`` trajectories that branch right after its first tool
    result (as ARPO branches); rewards alternate so every group has signal."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731

    def body(first: list[int] | None = None) -> tuple[list[int], list[int]]:
        resp, mask = [], []
        for k in range(SEGMENTS):
            seg = first if (k == 0 and first is not None) else ids(SEGMENT)
            resp += seg
            mask += [1] * len(seg)
            if k < SEGMENTS - 1:
                resp += ids(TOOL_TOKENS)
                mask += [0] * TOOL_TOKENS
        return resp, mask

    groups = []
    for gi in range(num_groups):
        prompt = ids(8)
        root, root_mask = body()
        bp = SEGMENT + TOOL_TOKENS  # right after the first tool result
        # (response, mask, parent, branch point) per trajectory; the root has neither parent nor branch point
        trajs: list[tuple[list[int], list[int], int | None, int | None]] = [(root, root_mask, None, None)]
        for _ in range(branches):
            tail, tail_mask = body()
            resp = root[:bp] + tail[bp:]
            mask = root_mask[:bp] + tail_mask[bp:]
            trajs.append((resp, mask, 0, bp))
        out = []
        for j, (resp, mask, parent, branch_point) in enumerate(trajs):
            lp = _logprobs(model, prompt, resp)
            old = [x if m else 0.0 for x, m in zip(lp, mask)]
            out.append(
                Trajectory(
                    traj_id=j,
                    response_ids=resp,
                    trained_mask=mask,
                    old_logprobs=old,
                    entropies=[0.0] * len(resp),
                    reward=float(j % 2),
                    parent=parent,
                    branch_point=branch_point,
                    kind="initial" if parent is None else "branch",
                )
            )
        groups.append(Group(prompt_index=gi, prompt_ids=prompt, trajectories=out))
    return groups


def plant_tool_first_token(groups: list[Group], nats: float = 1.0) -> list[Group]:
    """A ``nats`` error on the sampler's log-prob of the first token after each tool result."""

    def fault(t: Trajectory) -> Trajectory:
        old = list(t.old_logprobs)
        for i in range(1, len(old)):
            if t.trained_mask[i] and not t.trained_mask[i - 1]:
                old[i] -= nats
        return replace(t, old_logprobs=old)

    return [replace(g, trajectories=[fault(t) for t in g.trajectories]) for g in groups]


def plant_kv_reuse(groups: list[Group], model: Any) -> list[Group]:
    """A bad KV reuse at one branch point: the first branch of the first group continued on another prompt's cached
    prefix, so the sampler's log-probs of its tokens after the branch point are those of the wrong context."""
    g, other = groups[0], groups[1]
    t = next(t for t in g.trajectories if t.branch_point is not None)
    bp = t.branch_point
    wrong_context = other.prompt_ids + other.trajectories[0].response_ids[:bp]
    lp = _logprobs(model, wrong_context, t.response_ids[bp:])
    old = list(t.old_logprobs[:bp]) + [x if m else 0.0 for x, m in zip(lp, t.trained_mask[bp:])]
    bad = replace(t, old_logprobs=old)
    return [replace(g, trajectories=[bad if u is t else u for u in g.trajectories]), *groups[1:]]
