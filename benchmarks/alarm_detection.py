"""Which local faults the rollout/learner mismatch alarm detects, and whether it false-alarms: groups whose sampler
log-probs are the model's own (the clean case), then the same groups with a planted fault, each scored by the
learner with its default fp32 levels (the token mean ``kl_rollout`` and the tail statistics ``logprob_tail_frac``
and ``kl_rollout_traj_max``).

Planted faults: a 1-nat error on the first token after each tool result (1% of the sampled tokens), and a bad KV
reuse at one branch point (one branch's tokens after it scored on another prompt's cached prefix).

    python -m benchmarks.alarm_detection --model <a model folder or name> --seeds 5
"""

from __future__ import annotations

import argparse
import platform
import random
import subprocess
from dataclasses import replace
from typing import Any

import torch

from arpo_algo.rollout.types import Group, Trajectory

#: Sampled tokens per segment; a tool result follows each segment but the last, so with SEGMENTS = 5 the first token
#: after a tool result is 4 of 400 sampled tokens (1%).
SEGMENT, SEGMENTS, TOOL_TOKENS = 80, 5, 6


@torch.no_grad()
def _logprobs(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """The model's log-prob of every response token given everything before it (eval mode, float32)."""
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
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
        trajs = [(root, root_mask, None, None)]
        for _ in range(branches):
            tail, tail_mask = body()
            resp = root[:bp] + tail[bp:]
            mask = root_mask[:bp] + tail_mask[bp:]
            trajs.append((resp, mask, 0, bp))
        out = []
        for j, (resp, mask, parent, branch_point) in enumerate(trajs):
            lp = _logprobs(model, prompt, resp)
            old = [x if m else 0.0 for x, m in zip(lp, mask)]
            out.append(Trajectory(traj_id=j, response_ids=resp, trained_mask=mask, old_logprobs=old,
                                  entropies=[0.0] * len(resp), reward=float(j % 2), parent=parent,
                                  branch_point=branch_point, kind="initial" if parent is None else "branch"))
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


def verdict(m: dict[str, float], config: Any, precision: str = "fp32") -> dict[str, str]:
    """Per statistic: "stop", "warn" or "-" against ``config``'s levels for ``precision``."""
    levels = {"kl_rollout": config.mismatch_levels(precision), **{
        {"frac": "logprob_tail_frac", "traj": "kl_rollout_traj_max"}[k]: v
        for k, v in config.tail_levels(precision).items()}}
    return {k: "stop" if m[k] > s else "warn" if m[k] > w else "-" for k, (w, s) in levels.items()}


def main() -> None:
    from transformers import AutoModelForCausalLM

    from arpo_algo.models import resolve_model_path
    from arpo_algo.train.learner import Learner, LearnerConfig
    from arpo_algo.train.learner_config import ALARM_OFF

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--cases", default="clean,tool,kv", help="which of clean, tool, kv to run (comma-separated)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = LearnerConfig(lr=1e-6, micro_batch_tokens=2048)
    # the stop levels are off so every statistic is measured; the verdict compares them with the default levels
    learner = Learner(path, replace(config, **ALARM_OFF), seed=0)

    def scored(groups: list[Group]) -> dict[str, float]:
        # equal rewards: no signal, so the update is the alarm's scoring alone (no step, the weights stay)
        return learner.update([replace(g, trajectories=[replace(t, reward=0.0) for t in g.trajectories])
                               for g in groups])

    all_cases = {"clean": ("clean (false alarms)", lambda g: g),
                 "tool": ("1 nat on the first token after each tool result", plant_tool_first_token),
                 "kv": ("bad KV reuse at one branch point", lambda g: plant_kv_reuse(g, model))}
    unknown = set(args.cases.split(",")) - set(all_cases)
    if unknown:
        ap.error(f"unknown case(s) {', '.join(sorted(unknown))}; choose from {', '.join(all_cases)}")
    cases = dict(all_cases[c] for c in args.cases.split(","))
    names = ("kl_rollout", "logprob_tail_frac", "kl_rollout_traj_max")
    rows = []
    for case, plant in cases.items():
        values: dict[str, list[float]] = {k: [] for k in names}
        fired: dict[str, int] = {k: 0 for k in names}
        for seed in range(args.seeds):
            m = scored(plant(clean_groups(model, seed=seed)))
            for k, v in verdict(m, config).items():
                values[k].append(m[k])
                fired[k] += v != "-"
            rows.append((case, seed, m, verdict(m, config)))
        print(f"| {case} | " + " | ".join(f"{min(values[k]):.2g} to {max(values[k]):.2g} ({fired[k]}/{args.seeds})"
                                          for k in names) + " |", flush=True)
    cpu = subprocess.run("grep -o 'avx512[a-z_]*\\|amx[a-z_]*' /proc/cpuinfo | sort -u | tr '\\n' ' '",
                         shell=True, capture_output=True, text=True).stdout.strip()
    print(f"levels (warn, stop): kl_rollout {config.mismatch_levels('fp32')}, tail {config.tail_levels('fp32')}")
    print(f"machine: {platform.processor() or platform.machine()}, {cpu or 'no avx512/amx'}; torch {torch.__version__}")
    for case, seed, m, v in rows:
        print(f"  {case} seed {seed}: " + ", ".join(f"{k} {m[k]:.3g} ({v[k]})" for k in names))


if __name__ == "__main__":
    main()
