"""What recording rollout trees costs a training iteration, measured in one run.

One ARPO training (ToolMath, the learner and the HF engine in this process) runs ``--warmup`` untimed iterations and
then ``2 * --pairs`` timed ones, recording switched on and off in the order on, off, off, on, ... (so drift of a shared
machine falls on both sides). Reported: the median wall time of ``algo.train()`` with and without recording, their
ratio, and the median time the recording itself took (timed around it) as a share of the iteration time with
recording: the direct measure, which iteration-time noise does not blur.

    python -m benchmarks.bench_record_trees --model smollm2-135m-instruct --pairs 4 --out record.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from arpo_algo.algorithms import ARPOConfig


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    return " ".join(sorted(set(re.findall(r"\b(avx512[a-z_]*|amx[a-z_]*)\b", text)))) or "no avx512/amx"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registered model name or HF folder")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
    ap.add_argument("--budget", type=int, default=8, help="trajectories per prompt (M); N = M // 2")
    ap.add_argument("--max-response-tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=3, help="timed iterations with recording (and as many without)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="arpo-record-") as tmp:
        cfg = (
            ARPOConfig()
            .environment("arpo/ToolMath-v0", env_config={"levels": [1, 2], "max_tool_calls": 2})
            .training(model_path=args.model, prompts_per_step=args.prompts, lr=2.5e-5, entropy_coef=0.01)
            .tree(budget=args.budget, initial=max(1, args.budget // 2))
            .llm_rollouts(
                max_response_tokens=args.max_response_tokens,
                record_path=str(Path(tmp) / "trees"),
                record_max_groups=None,
            )
        )
        algo = cfg.build_algo()
        writer = algo.tree_writer
        spent: list[float] = []
        record = algo._record_trees

        def timed_record(*a: Any) -> None:  # the writer's whole share: advantages, decoding, JSON, the files
            t = time.perf_counter()
            record(*a)
            spent.append(time.perf_counter() - t)

        algo._record_trees = timed_record
        order = ["on", "off", "off", "on"] * args.pairs
        order = order[: 2 * args.pairs]
        times: dict[str, list[float]] = {"on": [], "off": []}
        record_s = []
        try:
            for i in range(args.warmup + len(order)):
                mode = "on" if i < args.warmup else order[i - args.warmup]
                algo.tree_writer = writer if mode == "on" else None
                spent.clear()
                t0 = time.perf_counter()
                algo.train()
                wall = time.perf_counter() - t0
                if i >= args.warmup:
                    times[mode].append(wall)
                    if mode == "on":
                        record_s.append(sum(spent))
        finally:
            algo.stop()
        sizes = [p.stat().st_size for p in (Path(tmp) / "trees").glob("iter_*.jsonl")]
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    res = {
        "model": args.model,
        "prompts": args.prompts,
        "budget": args.budget,
        "cpu": cpu_flags(),
        "threads": args.threads,
        "iteration_s_with": on,
        "iteration_s_without": off,
        "ratio_with_over_without": on / off,
        "record_s_median": statistics.median(record_s),
        "record_share": statistics.median(record_s) / on,
        "chunk_bytes_median": statistics.median(sizes),
        "iterations": times,
        "record_s": record_s,
    }
    print(
        f"CPU flags: {res['cpu']}; {args.threads} torch threads; {args.model}, {args.prompts} prompts x "
        f"{args.budget} trajectories"
    )
    print(f"iteration with recording {on:.3f} s, without {off:.3f} s: ratio {on / off:.3f}")
    print(
        f"the writer itself: {res['record_s_median'] * 1e3:.1f} ms per iteration = "
        f"{100 * res['record_share']:.2f}% of the iteration; chunk {res['chunk_bytes_median'] / 1e3:.0f} kB"
    )
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
