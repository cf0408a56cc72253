"""Tree economy on ToolMath: ARPO against GRPO at equal trajectory count, same prompts and seeds, side by side.

For each budget M, both samplers grow M trajectories for each of the same prompts (ToolMath levels 2-3, which need
two or more tool calls), with the same engine, seeds and response budget. Reported per group: tool calls (a call on a
shared prefix counts once: it ran once), tokens the engine generated, KV tokens reused, wall time. The ARPO target is
<= 0.75x GRPO's tool calls and <= 0.8x its tokens; an untuned model that rarely calls tools cannot branch much, so the
numbers are reported as measured.

    python -m benchmarks.bench_tree --model smollm2-135m-instruct --budgets 8 16 --out results.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout import metrics as MK
from arpo_algo.rollout.engines.base import SamplingParams
from arpo_algo.rollout.engines.hf.engine import HFEngine
from arpo_algo.rollout.sampler import TreeSampler
from arpo_env.core import ToolTextEnv


def run_one(engine: HFEngine, cfg: TreeConfig, tasks: list[int], args: argparse.Namespace) -> dict:
    """Sample one step with ``cfg``; per-group means of the economy numbers."""
    sampler = TreeSampler(
        engine,
        lambda: ToolTextEnv(task="toolmath", levels=tuple(args.levels)),
        cfg,
        SamplingParams(temperature=args.temperature),
        max_response_tokens=args.max_response_tokens,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    groups, m = sampler.sample(tasks, step=0)
    wall = time.perf_counter() - t0
    sampler.close()
    n = len(groups)
    trajs = [t for g in groups for t in g.trajectories]
    return {
        "tool_calls_per_group": sum(g.metrics[MK.GROUP_TOOL_CALLS] for g in groups) / n,
        "tokens_generated_per_group": m[MK.TOKENS_GENERATED] / n,
        "tokens_reused_per_group": m[MK.TOKENS_REUSED] / n,
        "trajectories_per_group": len(trajs) / n,
        "branches_per_group": m[MK.BRANCHES] / n,
        "fillups_per_group": m[MK.FILLUPS] / n,
        "trajectories_with_tool_call": sum(bool(t.tool_calls) for t in trajs) / len(trajs),
        "reward_mean": m[MK.REWARD_MEAN],
        "wall_s": wall,
        "time_generate_s": m[MK.TIME_GENERATE],
        "time_tools_s": m[MK.TIME_TOOLS],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registered model name or HF folder")
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--prompts", type=int, default=2, help="ToolMath tasks (levels given by --levels)")
    ap.add_argument("--levels", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--max-response-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--decision-rule", choices=["paper", "reference"], default="paper")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    engine = HFEngine(args.model, device=args.device, max_batch_size=16)
    tasks = list(range(args.prompts))
    results: dict = {"args": vars(args), "budgets": {}}
    for M in args.budgets:
        arpo = TreeConfig(budget=M, initial=M // 2, branch_factor=1, decision_rule=args.decision_rule)
        row = {"arpo": run_one(engine, arpo, tasks, args), "grpo": run_one(engine, TreeConfig.grpo(M), tasks, args)}
        a, g = row["arpo"], row["grpo"]
        row["ratio_tool_calls"] = (
            a["tool_calls_per_group"] / g["tool_calls_per_group"] if g["tool_calls_per_group"] else None
        )
        row["ratio_tokens"] = a["tokens_generated_per_group"] / max(g["tokens_generated_per_group"], 1.0)
        results["budgets"][str(M)] = row
        print(
            f"M={M:3d}  ARPO calls/group {a['tool_calls_per_group']:6.1f} tokens/group "
            f"{a['tokens_generated_per_group']:7.0f} branches {a['branches_per_group']:4.1f} | GRPO calls/group "
            f"{g['tool_calls_per_group']:6.1f} tokens/group {g['tokens_generated_per_group']:7.0f} | ratio calls "
            f"{row['ratio_tool_calls']} tokens {row['ratio_tokens']:.2f}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
