"""Benchmark: one decode workload on two (or more) checkouts of arpo, interleaved in one run.

A speed-up claimed against an earlier version of the engine is a ratio measured side by side on the same machine in
the same minutes (these machines are shared and drift). This script runs the decode benchmark's workload (the
prompts of :mod:`benchmarks.bench_engine`: a shared system prompt, eight questions, varied lengths; one request per
slot, ``--new-tokens`` each) through ``HFEngine(decode=...)`` of each source tree in turn, each in a fresh process
whose ``PYTHONPATH`` (and working directory) is that tree, for ``--rounds`` rounds, and prints tok/s per tree and
round, the medians and each tree's ratio to the first. The workload's token ids are made once, here, and handed to
every tree, so every tree decodes the same requests; only the engine's own public API (``HFEngine``, ``GenRequest``,
``SamplingParams``) is used inside a tree, so an older checkout runs unchanged.

Usage (a checkout of an earlier commit beside this one)::

    git worktree add ../arpo-base <commit>
    python -m benchmarks.ab_decode --trees ../arpo-base . --decode static --batch 32 --new-tokens 64 --rounds 2
    python -m benchmarks.ab_decode --trees ../arpo-base . . --dtype float32 float32 bfloat16   # a dtype per side
    python -m benchmarks.ab_decode --trees ../arpo-base . --decode static compiled            # a mode per side
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from arpo_algo.rollout.engines.hf.decode_mode import DECODE_MODES

_WORKER = """
import json, sys, time
import torch
cfg = json.load(sys.stdin)
torch.set_num_threads(cfg["threads"])
import arpo_algo
from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
from arpo_algo.rollout.engines.hf.engine import HFEngine
eng = HFEngine(cfg["model"], dtype=cfg["dtype"], max_batch_size=cfg["batch"], decode=cfg["decode"],
               static_cache_tokens=cfg["static_cache_tokens"], seed=cfg["seed"])
reqs = [GenRequest(i, p, SamplingParams(max_new_tokens=cfg["new_tokens"], seed=cfg["seed"] + i))
        for i, p in enumerate(cfg["prompts"])]
eng.generate(reqs)  # warm-up on the same workload
eng.stats()
t0 = time.perf_counter()
gens = eng.generate(reqs)
seconds = time.perf_counter() - t0
errors = [g.error for g in gens if g.finish_reason == "error"]
if errors:
    sys.exit(f"{len(errors)} of {len(gens)} requests failed: {errors[0]} (raise --static-cache-tokens?)")
stats = {k: float(v) for k, v in eng.stats().items() if isinstance(v, (int, float))}
print("AB_RESULT " + json.dumps({"package": arpo_algo.__file__, "tokens": sum(len(g.token_ids) for g in gens),
                                 "seconds": seconds, "stats": stats}))
"""


def _run_tree(tree: Path, cfg: dict) -> dict:
    """One timed run of the workload ``cfg`` with ``tree`` first on the import path; its result record."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER], input=json.dumps(cfg), env=env, cwd=tree, capture_output=True, text=True
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("AB_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"the run in {tree} failed (exit {proc.returncode}):\n{proc.stderr.strip()[-3000:]}")
    res = json.loads(line[len("AB_RESULT ") :])
    if not Path(res["package"]).resolve().is_relative_to(tree):
        raise SystemExit(f"the run in {tree} imported arpo_algo from {res['package']}, not from that tree")
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--trees",
        nargs="+",
        required=True,
        type=Path,
        help="source trees (checkouts) to compare; the first is the baseline of the ratios",
    )
    ap.add_argument(
        "--decode",
        nargs="+",
        default=["static"],
        choices=DECODE_MODES,
        help="one HFEngine decode mode for every tree, or one per tree (e.g. the old static step against "
        "a new compiled one)",
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--dtype",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16", "float16"],
        help="one dtype for every tree, or one per tree (the same tree may be named twice)",
    )
    ap.add_argument("--batch", type=int, default=32, help="slots = requests")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--static-cache-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="timed runs per tree, interleaved")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    args.trees = [tree.resolve() for tree in args.trees]  # the runs start inside each tree: no relative paths
    for tree in args.trees:
        if not (tree / "arpo_algo" / "rollout" / "engines" / "hf" / "engine.py").is_file():
            ap.error(f"{tree} is not an arpo checkout (no arpo_algo/rollout/engines/hf/engine.py)")
    if args.batch < 1 or args.new_tokens < 1 or args.rounds < 1:
        ap.error("--batch, --new-tokens and --rounds must be at least 1")
    if len(args.dtype) not in (1, len(args.trees)):
        ap.error(f"--dtype takes one dtype or one per tree ({len(args.trees)}), not {len(args.dtype)}")
    if len(args.decode) not in (1, len(args.trees)):
        ap.error(f"--decode takes one mode or one per tree ({len(args.trees)}), not {len(args.decode)}")
    dtypes = args.dtype * len(args.trees) if len(args.dtype) == 1 else args.dtype
    decodes = args.decode * len(args.trees) if len(args.decode) == 1 else args.decode
    sides = [
        (tree, dtype, decode, f"{tree} {dtype} {decode}") for tree, dtype, decode in zip(args.trees, dtypes, decodes)
    ]
    if len({label for *_, label in sides}) < len(sides):
        ap.error("every (tree, dtype, decode) may be named once")

    from transformers import AutoTokenizer

    from arpo_algo.models import resolve_model_path
    from benchmarks.bench_engine import _prompts

    model = str(resolve_model_path(args.model))
    prompts = _prompts(AutoTokenizer.from_pretrained(model), args.batch, random.Random(args.seed))
    cfg = {
        "model": model,
        "batch": args.batch,
        "static_cache_tokens": args.static_cache_tokens,
        "seed": args.seed,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "prompts": prompts,
    }
    runs: dict[str, list[dict]] = {label: [] for *_, label in sides}
    print(
        f"batch {args.batch}, {args.new_tokens} new tokens per request, "
        f"{args.threads} threads, {args.rounds} interleaved round(s)\n"
    )
    print("| tree, dtype, decode | round | tok/s | prefill s | steps |")
    print("|---|---|---|---|---|")
    for r in range(args.rounds):
        for tree, dtype, decode, label in sides:
            res = _run_tree(tree, dict(cfg, dtype=dtype, decode=decode))
            res["tok_s"] = res["tokens"] / res["seconds"]
            runs[label].append(res)
            st = res["stats"]
            pre = f"{st['prefill_seconds']:.2f}" if "prefill_seconds" in st else "-"
            print(f"| {label} | {r + 1} | {res['tok_s']:.1f} | {pre} | {st.get('decode_steps', 0):.0f} |", flush=True)
    base = statistics.median(x["tok_s"] for x in runs[sides[0][-1]])
    print("\n| tree, dtype, decode | median tok/s | vs first |")
    print("|---|---|---|")
    summary = {}
    for label, rs in runs.items():
        med = statistics.median(x["tok_s"] for x in rs)
        summary[label] = {"median_tok_s": med, "vs_first": med / base}
        print(f"| {label} | {med:.1f} | {med / base:.2f}x |")
    out = {"config": {k: v for k, v in cfg.items() if k != "prompts"}, "runs": runs, "summary": summary}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
