"""Which trained tokens carry a learning signal? Read from the rollout trees a training run recorded.

    python -m studies.credit_share runs/compare/compare_arpo_branching/seed_0 runs/compare/other/seed_0
    python -m studies.credit_share --runs-under runs/compare        # every run folder with trees below it

Per run folder (its ``trees/iter_*.jsonl``, as ``arpo train`` writes them by default), over the groups whose rewards
differ (a group without reward spread has no signal under any estimator): the share of trained tokens whose
advantage is not zero, and the mean absolute advantage of a trained token. GRPO's outcome advantage reaches every
trained token of such a group; an estimator that credits turns can leave tokens at zero (a turn after which nothing
branched has the value of the trajectory it leads to, so its credit is 0). Prints one row per run and the mean per
configuration (the run folder's parent).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def group_share(group: dict[str, Any]) -> tuple[int, int, float] | None:
    """(trained tokens, trained tokens with a nonzero advantage, sum of |advantage| over trained tokens) of one
    recorded group; None when its rewards are all equal."""
    trajs = group["trajectories"]
    if len({t["reward"] for t in trajs}) < 2:
        return None
    trained = nonzero = 0
    total = 0.0
    for t in trajs:
        for m, a in zip(t["trained_mask"], t["advantages"]):
            if m:
                trained += 1
                nonzero += a != 0.0
                total += abs(a)
    return trained, nonzero, total


def run_share(run: Path) -> dict[str, float]:
    """The shares of one run folder, over every recorded iteration."""
    files = sorted((run / "trees").glob("iter_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{run} has no recorded trees (trees/iter_*.jsonl)")
    trained = nonzero = groups = 0
    total = 0.0
    for f in files:
        for line in f.read_text().splitlines():
            got = group_share(json.loads(line)) if line.strip() else None
            if got is not None:
                groups += 1
                trained, nonzero, total = trained + got[0], nonzero + got[1], total + got[2]
    return {
        "groups_with_spread": groups,
        "trained_tokens": trained,
        "nonzero_share": nonzero / trained if trained else 0.0,
        "mean_abs_advantage": total / trained if trained else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="*", type=Path, help="run folders (each with trees/)")
    ap.add_argument("--runs-under", type=Path, default=None, help="every run folder with trees below this folder")
    args = ap.parse_args(argv)
    runs = list(args.runs)
    if args.runs_under is not None:
        runs += sorted(p.parent for p in args.runs_under.rglob("trees") if p.is_dir())
    if not runs:
        print("error: give run folders or --runs-under", file=sys.stderr)
        return 2
    by_config: dict[str, list[dict[str, float]]] = {}
    print("| run | groups with spread | trained tokens | share with a nonzero advantage | mean abs advantage |")
    print("|---|---:|---:|---:|---:|")
    for run in runs:
        try:
            r = run_share(run)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        by_config.setdefault(run.parent.name, []).append(r)
        print(
            f"| {run.parent.name}/{run.name} | {r['groups_with_spread']} | {r['trained_tokens']} | "
            f"{r['nonzero_share']:.3f} | {r['mean_abs_advantage']:.3f} |"
        )
    print("\n| configuration | runs | share with a nonzero advantage (mean) | mean abs advantage (mean) |")
    print("|---|---:|---:|---:|")
    for name, rows in by_config.items():
        share = statistics.mean(r["nonzero_share"] for r in rows)
        mag = statistics.mean(r["mean_abs_advantage"] for r in rows)
        print(f"| {name} | {len(rows)} | {share:.3f} | {mag:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
