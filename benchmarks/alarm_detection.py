"""Which local faults the rollout/learner mismatch alarm detects, and whether it false-alarms: groups whose sampler
log-probs are the model's own (the clean case), then the same groups with a planted fault, each scored by the
learner with its default levels (the token mean ``kl_rollout`` and the tail statistics ``logprob_tail_frac`` and
``kl_rollout_traj_max``). The sampler's log-probs are always the fp32 model's; ``--precision bf16`` scores them with a
bf16-autocast learner (the quickstart's learner on a CPU with bf16 in hardware) against the bf16 levels, so bf16
rounding adds to every statistic as it does in such a run.

Planted faults: a 1-nat error on the first token after each tool result (1% of the sampled tokens), and a bad KV
reuse at one branch point (one branch's tokens after it scored on another prompt's cached prefix).

    python -m benchmarks.alarm_detection --model <a model folder or name> --seeds 5 [--precision bf16]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
from dataclasses import replace
from typing import Any

import torch

from arpo_algo.rollout.synthetic import clean_groups, plant_kv_reuse, plant_tool_first_token
from arpo_algo.rollout.types import Group


def verdict(m: dict[str, float], config: Any, precision: str = "fp32") -> dict[str, str]:
    """Per statistic: "stop", "warn" or "-" against ``config``'s levels for ``precision``."""
    levels = {
        "kl_rollout": config.mismatch_levels(precision),
        **{
            {"frac": "logprob_tail_frac", "traj": "kl_rollout_traj_max"}[k]: v
            for k, v in config.tail_levels(precision).items()
        },
    }
    return {k: "stop" if m[k] > s else "warn" if m[k] > w else "-" for k, (w, s) in levels.items()}


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from arpo_algo.models import resolve_model_path
    from arpo_algo.train.learner import Learner, LearnerConfig
    from arpo_algo.train.learner_config import ALARM_OFF

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--cases", default="clean,tool,kv", help="which of clean, tool, kv to run (comma-separated)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="the learner's compute precision")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    path = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # the levels a run of this learner against an fp32 sampler on a CPU defaults to (bf16: the bf16_cpu levels)
    config = LearnerConfig(lr=1e-6, micro_batch_tokens=2048, precision=args.precision).for_sampler("float32", "cpu")
    # the stop levels are off so every statistic is measured; the verdict compares them with the default levels
    learner = Learner(path, replace(config, **ALARM_OFF), seed=0)

    def scored(groups: list[Group]) -> dict[str, float]:
        # equal rewards: no signal, so the update is the alarm's scoring alone (no step, the weights stay)
        return learner.update(
            [replace(g, trajectories=[replace(t, reward=0.0) for t in g.trajectories]) for g in groups]
        )

    all_cases = {
        "clean": ("clean (false alarms)", lambda g: g),
        "tool": ("1 nat on the first token after each tool result", plant_tool_first_token),
        "kv": ("bad KV reuse at one branch point", lambda g: plant_kv_reuse(g, model)),
    }
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
            for k, v in verdict(m, config, args.precision).items():
                values[k].append(m[k])
                fired[k] += v != "-"
            rows.append((case, seed, m, verdict(m, config, args.precision)))
        print(
            f"| {case} | "
            + " | ".join(f"{min(values[k]):.2g} to {max(values[k]):.2g} ({fired[k]}/{args.seeds})" for k in names)
            + " |",
            flush=True,
        )
    cpu = subprocess.run(
        "grep -o 'avx512[a-z_]*\\|amx[a-z_]*' /proc/cpuinfo | sort -u | tr '\\n' ' '",
        shell=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(
        f"learner {args.precision}; levels (warn, stop): kl_rollout {config.mismatch_levels(args.precision)}, "
        f"tail {config.tail_levels(args.precision)}"
    )
    print(f"machine: {platform.processor() or platform.machine()}, {cpu or 'no avx512/amx'}; torch {torch.__version__}")
    for case, seed, m, v in rows:
        print(f"  {case} seed {seed}: " + ", ".join(f"{k} {m[k]:.3g} ({v[k]})" for k in names))


if __name__ == "__main__":
    main()
