"""Rollout tokens/s of one ARPO sampling step: lockstep rounds against waves, side by side in one process.

The step is the quickstart RL recipe's (``arpo_algo/run/recipes/quickstart.toml``: its tree, environment, prompts per
step, response budget, temperature and engine batch) on the HF engine. Each round samples the same step (same tasks,
step number and seed) once per schedule, in alternating order from round to round so a change of the machine's load
falls on both sides, on one engine. Printed per schedule and round: the tokens the engine generated, the step's wall
time, tokens/s over that wall time and over the time spent inside engine calls, the tokens per model forward (how
full the batch was: a figure the machine's load does not change), and the engine calls made; and whether both
schedules grew the same trees (token ids, masks and branch points; they must).

    python -m benchmarks.rollout_schedule --model runs/quickstart/sft --rounds 2 --threads 2

``--model`` is the checkpoint to sample from (the quickstart samples its RL step from its SFT checkpoint); a folder
without tokenizer files takes the tokenizer of ``--tokenizer`` (default: the recipe's base model).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_sandbox import _cpu_flags

SCHEDULES = ("rounds", "waves")


def recipe() -> dict[str, Any]:
    """The quickstart RL recipe, read from the file the quickstart trains with (so the two cannot drift apart)."""
    from arpo_algo.run.quickstart import RECIPES
    from arpo_base.options import read_toml

    return read_toml(RECIPES / "quickstart.toml")


def sample_once(engine: Any, r: dict[str, Any], schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    """One sampling step under ``schedule``: its numbers and a fingerprint of its trees."""
    import functools

    from arpo_algo.algorithms.components import make_env
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.rollout import metrics as MK
    from arpo_algo.rollout.config import RolloutsConfig
    from arpo_algo.rollout.sampler import TreeSampler

    env = {k: v for k, v in r["env"].items() if k != "id"}
    creator = functools.partial(make_env, r["env"]["id"], env, None)
    tree = TreeConfig.from_dict({"mode": r["experiment"]["algorithm"], **r["tree"]})
    rollouts = RolloutsConfig(
        temperature=r["rollouts"]["temperature"],
        max_response_tokens=args.max_response_tokens or r["rollouts"]["max_response_tokens"],
    )
    calls: list[int] = []
    generate = engine.generate

    def counted(requests: list, **kw: Any) -> list:
        out = generate(requests, **kw)
        calls.append(len(out))
        return out

    engine.generate = counted
    sampler = TreeSampler.from_config(engine, creator, tree, rollouts, seed=args.seed, schedule=schedule)
    tasks = list(range(args.prompts or r["training"]["prompts_per_step"]))
    try:
        t0 = time.perf_counter()
        groups, m = sampler.sample(tasks, step=args.step)
        wall = time.perf_counter() - t0
    finally:
        sampler.close()
        del engine.generate
    tokens = m[MK.TOKENS_GENERATED]
    trees = [
        [(t.traj_id, t.parent, t.branch_point, t.response_ids, t.trained_mask) for t in g.trajectories] for g in groups
    ]
    return {
        "schedule": schedule,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "generate_s": m[MK.TIME_GENERATE],
        "tokens_per_generate_s": tokens / m[MK.TIME_GENERATE] if m[MK.TIME_GENERATE] else 0.0,
        # rows per decode forward (prefill forwards included): how full the engine's batch was, whatever the load
        "tokens_per_forward": tokens / max(1.0, m.get(f"{MK.ROLLOUT}engine/forward_calls", 0.0)),
        "engine_calls": len(calls),
        "requests": sum(calls),
        "trees": trees,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint folder or registered model name to sample from")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder or name (default: the model's, else the base)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds; each samples the step once per schedule")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--prompts", type=int, default=0, help="prompts of the step (0: the recipe's prompts_per_step)")
    ap.add_argument("--max-response-tokens", type=int, default=0, help="0: the recipe's")
    ap.add_argument("--max-batch-size", type=int, default=0, help="engine batch (0: the recipe's rollouts.hf)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from arpo_algo.models import resolve_model_path
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    r = recipe()
    path = resolve_model_path(str(args.model))
    tok_src = args.tokenizer or (path if (Path(path) / "tokenizer.json").exists() else r["model"]["path"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(str(tok_src)))
    engine = HFEngine(path, tokenizer, max_batch_size=args.max_batch_size or r["rollouts"]["hf"]["max_batch_size"])
    print(
        f"machine: {platform.machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"CPU flags: {_cpu_flags()}; engine decode={engine.decode}, batch {engine.max_batch_size}"
    )
    rows, same = [], []
    for i in range(args.rounds):
        order = SCHEDULES if i % 2 == 0 else SCHEDULES[::-1]
        got = {s: sample_once(engine, r, s, args) for s in order}
        same.append(got["rounds"]["trees"] == got["waves"]["trees"])
        for s in order:
            row = {k: v for k, v in got[s].items() if k != "trees"}
            rows.append({"round": i, **row})
            print(
                f"round {i} {s:>6}: {row['tokens']:.0f} tokens in {row['wall_s']:.1f} s = "
                f"{row['tokens_per_s']:.1f} tokens/s ({row['tokens_per_generate_s']:.1f} per second inside engine "
                f"calls); {row['tokens_per_forward']:.2f} tokens per forward; {row['engine_calls']} engine calls, "
                f"{row['requests']} requests"
            )
    by = {s: [x for x in rows if x["schedule"] == s] for s in SCHEDULES}
    ratio = sum(x["tokens_per_s"] for x in by["waves"]) / max(1e-9, sum(x["tokens_per_s"] for x in by["rounds"]))
    print(f"same trees in every round: {all(same)}; waves / rounds tokens/s: {ratio:.2f}x")
    out = {"rows": rows, "same_trees": all(same), "ratio": ratio, "cpu_flags": _cpu_flags()}
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
