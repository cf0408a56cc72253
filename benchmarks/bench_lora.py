"""LoRA against full weights on one learner: step time, peak memory, checkpoint size and the size of a weight copy.

    python -m benchmarks.bench_lora [--model smollm2-135m-instruct] [--rank 16] [--rounds 2] [--steps 3]
                                    [--prompts 4] [--budget 4] [--tokens 192] [--prompt-tokens 150]
                                    [--micro-batch-tokens 1024] [--[no-]gradient-checkpointing] [--out FILE]

Each variant runs in its own fresh process (so its peak resident memory is its own), ``--rounds`` times, alternating
full, LoRA, full, LoRA, ...: machine noise lands on both alike and the ratios come from the same run. The defaults
are the quickstart's RL step (4 prompts x budget 4, 192 response tokens, micro-batches of 1024 tokens, activation
checkpointing). A process loads the learner (fp32 weights, AdamW), builds one step's worth of GRPO groups from
random tokens (``--prompts`` x ``--budget`` trajectories of ``--tokens`` tokens after a ``--prompt-tokens`` prompt,
rewards spread so every group has signal), takes ``--steps`` updates on them and reports: the median update time
after the first (the first also creates AdamW's state), the peak RSS after loading and after the updates, the bytes
a checkpoint's policy folder and trainer state take, and the bytes of ``rollout_weights()``: what one copy of the
weights moves (an async snapshot, a rollout actor's sync).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(args: argparse.Namespace) -> dict:
    """One variant in this process."""
    import random

    import torch

    from arpo_algo.algorithms.checkpoint import save_trainer_state
    from arpo_algo.models.lora import LoraSettings
    from arpo_algo.rollout.types import Group, Trajectory
    from arpo_algo.train.backends import LocalLearner
    from arpo_algo.train.learner import LearnerConfig
    from arpo_algo.train.learner_config import ALARM_OFF

    lora = LoraSettings(enabled=True, rank=args.rank, alpha=2.0 * args.rank) if args.variant == "lora" else None
    # random tokens are not what the model would sample: the mismatch alarm has nothing to say here
    silent = {**ALARM_OFF, **{k.replace("_stop", "_warn"): math.inf for k in ALARM_OFF}}
    cfg = LearnerConfig(
        lr=5e-5,
        **silent,
        micro_batch_tokens=args.micro_batch_tokens,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    start = _peak_mib()
    learner = LocalLearner(args.model, cfg, seed=0, lora=lora)
    loaded = _peak_mib()
    rng = random.Random(0)
    vocab = learner.tokenizer.vocab_size
    groups = []
    for i in range(args.prompts):
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
        trajs = [
            Trajectory(j, ids, [1] * len(ids), [-1.0] * len(ids), [1.0] * len(ids), reward=float(j % 2))
            for j, ids in enumerate(
                [[rng.randrange(100, vocab) for _ in range(args.tokens)] for _ in range(args.budget)]
            )
        ]
        groups.append(Group(i, prompt, trajs))
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        learner.update(groups)
        times.append(time.perf_counter() - t0)
    updated = _peak_mib()
    copy = learner.rollout_weights()
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "policy"
        learner.save_pretrained(policy)
        save_trainer_state(learner.get_state(), Path(tmp) / "trainer_state.pt")
        policy_bytes = _folder_bytes(policy) - sum(p.stat().st_size for p in policy.glob("tokenizer*"))
        state_bytes = (Path(tmp) / "trainer_state.pt").stat().st_size
    return {
        "variant": args.variant,
        "trainable": sum(p.numel() for p in learner.model.parameters() if p.requires_grad),
        "step_s": statistics.median(times[1:] or times),
        "first_step_s": times[0],
        "peak_mib_start": start,
        "peak_mib_loaded": loaded,
        "peak_mib_updated": updated,
        "policy_bytes": policy_bytes,
        "trainer_state_bytes": state_bytes,
        "copy_bytes": sum(v.numel() * v.element_size() for v in copy.values()),
        "threads": torch.get_num_threads(),
    }


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = sorted({w for w in text.split() if w.startswith(("avx512", "amx"))})
    return " ".join(flags) or "no avx512/amx"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024, help="the quickstart's")
    ap.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True, help="the quickstart's (on)"
    )
    ap.add_argument("--out", default=None, help="write the rows and the summary as JSON here")
    ap.add_argument("--variant", choices=("full", "lora"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variant:  # a child: one variant, one JSON line
        print(json.dumps(measure(args)))
        return 0
    child = [
        sys.executable,
        "-m",
        "benchmarks.bench_lora",
        "--model",
        args.model,
        "--rank",
        str(args.rank),
        "--steps",
        str(args.steps),
        "--prompts",
        str(args.prompts),
        "--budget",
        str(args.budget),
        "--tokens",
        str(args.tokens),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--micro-batch-tokens",
        str(args.micro_batch_tokens),
        "--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing",
    ]
    rows = []
    for r in range(args.rounds):
        for variant in ("full", "lora"):
            proc = subprocess.run(
                [*child, "--variant", variant], capture_output=True, text=True, env=os.environ, check=False
            )
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({**row, "round": r})
            print(json.dumps(rows[-1]), flush=True)
    summary = summarize(rows)
    print(
        f"\nmodel {args.model}, rank {args.rank}, {args.prompts}x{args.budget} trajectories of {args.tokens} tokens"
        f" after {args.prompt_tokens}; CPU flags: {cpu_flags()}; {rows[0]['threads']} torch threads\n"
    )
    print("| | full weights | LoRA | LoRA / full |")
    print("|---|---|---|---|")
    for key, label in (
        ("step_s", "learner step (s, median)"),
        ("peak_mib_updated", "peak RSS after updates (MiB)"),
        ("peak_mib_loaded", "peak RSS after loading (MiB)"),
        ("policy_bytes", "policy folder (MB)"),
        ("trainer_state_bytes", "trainer state (MB)"),
        ("copy_bytes", "one weight copy (MB)"),
    ):
        full, lora = summary[key]["full"], summary[key]["lora"]
        scale = 1e6 if key.endswith("bytes") else 1.0
        print(f"| {label} | {full / scale:.3g} | {lora / scale:.3g} | {lora / full:.3g} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


def summarize(rows: list[dict]) -> dict:
    """Per measured key, the median over rounds of each variant."""
    keys = (
        "step_s",
        "first_step_s",
        "peak_mib_loaded",
        "peak_mib_updated",
        "policy_bytes",
        "trainer_state_bytes",
        "copy_bytes",
        "trainable",
    )
    return {k: {v: statistics.median(r[k] for r in rows if r["variant"] == v) for v in ("full", "lora")} for k in keys}


if __name__ == "__main__":
    sys.exit(main())
