"""Does the held-out evaluation give the same answers at another engine batch, and how much faster is it?

    python -m benchmarks.eval_batch --checkpoints runs/quickstart/sft runs/quickstart/policy \
        [--batches 16 32] [--rounds 2] [--experiment quickstart] [--set section.key=value]

Each checkpoint is evaluated under the experiment's evaluation settings (the quickstart's by default: 32 ToolMath
level-3 test tasks, greedy, 192 response tokens) by a fresh ``HFEngine`` per batch size, the batch sizes interleaved
for ``--rounds`` rounds so that a drifting machine weighs on each alike. Prints, per checkpoint: the tasks whose
every response (token ids, tool results included) is the same at every batch size, the accuracy at each, and the
median wall time per batch size with its ratio to the first. Exit status 1 when any answer differs: then the batch
is part of the result and the two batch sizes are two results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any


def responses(groups: list[Any]) -> list[tuple[tuple[int, ...], ...]]:
    """Per task (in task order), the token ids of each of its trajectories."""
    return [tuple(tuple(t.response_ids) for t in g.trajectories) for g in groups]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoints", nargs="+", required=True, help="HF checkpoint folders")
    ap.add_argument(
        "--batches", type=int, nargs="+", default=[16, 32], help="engine batch sizes; the first is the base"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--experiment", default="quickstart", help="whose evaluation settings (a name or a file)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args(argv)

    import torch

    from arpo_algo.algorithms.components import env_creator
    from arpo_algo.eval.evaluation import eval_settings, sample_held_out
    from arpo_algo.rollout import metrics as MK
    from arpo_algo.rollout.engines.hf.engine import HFEngine
    from arpo_algo.run.experiment import load_experiment
    from arpo_base.errors import ArpoError

    try:
        exp = load_experiment(args.experiment, [f"model.path={json.dumps(args.checkpoints[0])}", *args.set])
    except ArpoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = exp.config
    settings = eval_settings(cfg).as_kwargs()
    creator = env_creator(cfg, split=cfg.settings.evaluation.split)
    rollouts = cfg.settings.rollouts
    print(f"evaluation: {settings}; torch threads {torch.get_num_threads()}", flush=True)

    answers: dict[tuple[str, int], list] = {}
    accuracy: dict[tuple[str, int], float] = {}
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for path in args.checkpoints:
            for b in args.batches:
                engine = HFEngine(path, **{**rollouts.hf.engine_kwargs(), "max_batch_size": b}, seed=cfg.seed)
                t0 = time.perf_counter()
                groups = sample_held_out(engine, creator, **settings)
                times.setdefault((path, b), []).append(time.perf_counter() - t0)
                got = responses(groups)
                if answers.setdefault((path, b), got) != got:
                    print(f"  note: {path} at batch {b} answered differently in round {r + 1} than in round 1")
                accuracy[(path, b)] = MK.quality(MK.summarize(groups))[MK.ACCURACY]
                print(f"round {r + 1}: {path} batch {b}: {times[(path, b)][-1]:.1f} s", flush=True)
                del engine

    differ = 0
    base = args.batches[0]
    for path in args.checkpoints:
        ref = answers[(path, base)]
        same = [i for i in range(len(ref)) if all(answers[(path, b)][i] == ref[i] for b in args.batches)]
        differ += len(ref) - len(same)
        print(f"\n{path}: {len(same)} of {len(ref)} tasks answered the same at batches {args.batches}")
        base_t = statistics.median(times[(path, base)])
        for b in args.batches:
            t = statistics.median(times[(path, b)])
            print(
                f"  batch {b:>3}: accuracy {accuracy[(path, b)]:.3f}, median {t:.1f} s, {t / base_t:.2f}x batch {base}"
            )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
