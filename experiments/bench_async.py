"""Iteration time of synchronous against asynchronous rollouts, in one run, with Ray rollout actors.

Both modes train the same config from the same seed (ARPO on ToolMath; ``rollouts.num_rollout_actors`` actors, the
learner in this process), one after the other in the order ``--order`` gives (a repeated order such as
``sync,async,async,sync`` spreads drift of a shared machine over both). Each mode runs ``--warmup`` untimed iterations
and then ``--iterations`` timed ones; an iteration's time is the wall time of ``algo.train()``. Reported per mode: the
median and every iteration's time, and the medians of the sampling and the update time; and the ratio
synchronous / asynchronous of the median iteration times (above 1: asynchronous is faster).

    python -m experiments.bench_async --model smollm2-135m-instruct --iterations 4 --out async.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from arpo_algo.algorithms import ARPOConfig


def build_config(args: argparse.Namespace, asynchronous: bool) -> ARPOConfig:
    cfg = (ARPOConfig()
           .environment("arpo/ToolMath-v0", env_config={"levels": list(args.levels), "max_tool_calls": 2})
           .training(model_path=args.model, prompts_per_step=args.prompts, lr=2.5e-5, entropy_coef=args.entropy_coef)
           .tree(budget=args.budget, initial=max(1, args.budget // 2))
           .llm_rollouts(max_response_tokens=args.max_response_tokens, num_rollout_actors=args.actors,
                         num_cpus_per_rollout_actor=args.cpus_per_actor, asynchronous=asynchronous,
                         max_staleness=1))
    cfg.seed = args.seed
    return cfg


def run_mode(args: argparse.Namespace, asynchronous: bool) -> dict[str, Any]:
    """Warm-up, then timed iterations of one mode; per-iteration times and the medians of their parts."""
    algo = build_config(args, asynchronous).build_algo()
    rows = []
    try:
        for i in range(args.warmup + args.iterations):
            t0 = time.perf_counter()
            result = algo.train()
            wall = time.perf_counter() - t0
            if i >= args.warmup:
                rollout, learner = result["rollout"], result["learner"]
                # this iteration's own numbers (RLlib's timers are smoothed over iterations, so they are not used)
                rows.append({"iteration_s": wall, "sampling_s": rollout["time_total_s"],
                             "update_s": result["tokens_sampled"] / max(result["update_tokens_per_s"], 1e-9),
                             "staleness_max": rollout["staleness_max"], "kl_rollout": learner["kl_rollout"],
                             "optimizer_steps": learner["optimizer_steps"]})
    finally:
        algo.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
    return {"median": med, "iterations": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registered model name or HF folder")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per iteration")
    ap.add_argument("--budget", type=int, default=4, help="trajectories per prompt (M); N = M // 2")
    ap.add_argument("--levels", type=int, nargs="+", default=[3])
    ap.add_argument("--max-response-tokens", type=int, default=96)
    ap.add_argument("--entropy-coef", type=float, default=0.01,
                    help="> 0: every update is a real optimizer step (an untrained model rarely earns a reward)")
    ap.add_argument("--actors", type=int, default=1)
    ap.add_argument("--cpus-per-actor", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process (the learner)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--order", default="sync,async", help="comma-separated modes, run in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    for mode in args.order.split(","):
        if mode not in runs:
            ap.error(f"--order: unknown mode {mode!r} (sync, async)")
        runs[mode].append(run_mode(args, asynchronous=mode == "async"))
    medians = {m: statistics.median(r["iteration_s"] for run in rs for r in run["iterations"])
               for m, rs in runs.items() if rs}
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "median_iteration_s": medians}
    if len(medians) == 2:
        out["ratio_sync_over_async"] = medians["sync"] / medians["async"]
    print(json.dumps({"median_iteration_s": medians, "ratio_sync_over_async": out.get("ratio_sync_over_async")}))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
