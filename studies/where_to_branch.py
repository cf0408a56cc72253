"""Where to branch: does ARPO's entropy rule pick better branch points than random ones at the same count?

    python -m studies.where_to_branch plan
    python -m studies.where_to_branch sft --sft-seed S --output runs/where_to_branch/sft_S
    python -m studies.where_to_branch run --block B --sft-seed S --sft DIR [--arms entropy random grpo] [--dry-run]
    python -m studies.where_to_branch pilot --records FILE
    python -m studies.where_to_branch report --records FILE

The plan is fixed before the first block (``PLAN``, and in words in ``studies/where_to_branch_plan.md``; ``plan``
prints it). The setting is ``experiments/comparisons/compare_arpo_branching.toml`` (M = 8 trajectories per prompt
from 2 roots, Z = 2 clones per branch, the paper rule at tau = 0.485). The arms differ only in where the tree
branches: ``entropy`` (that file as it is), ``random`` (an equal-count control: each possible clone with the
probability the pilot fixes, decided after the same look-ahead) and ``grpo`` (8 independent samples); ``appo``, the
literature's look-ahead score, is a secondary arm run only once its threshold is recorded. Every arm has the same
budget and the same optimizer settings (:func:`check_arms`), fp32, and held-out accuracy on the first 258 test tasks
(256 distinct questions) after iterations 2, 4 and 6 (and before training); the endpoint is the mean of the last two
evaluations.

A block is one SFT checkpoint (its own SFT seed) with every arm of the design trained from it, RL seed = the block
number, in one invocation on one machine; its records carry the CPU's AVX-512 and AMX flags. The unit of analysis is
the block: per contrast the paired differences of the endpoint over blocks, the exact two-sided Wilcoxon
signed-rank test, the Hodges-Lehmann estimate with its exact interval, and Holm's adjustment over the contrasts.
``pilot`` estimates the spread of a paired difference from the pilot blocks without reading which arm a record is,
and the number of blocks that gives 80% power against a mean difference of 0.10.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from arpo_base.errors import ArpoError, ConfigError
from studies.compare import check_equal_budget, stats, wilcoxon
from studies.study import (
    check_block,
    code_hash,
    complete_blocks,
    drop_checkpoints,
    file_hash,
    machine,
    read_records,
    run_arm,
)
from studies.study_report import _null_counts, hodges_lehmann

ROOT = Path(__file__).resolve().parent.parent
FILE = "experiments/comparisons/compare_arpo_branching.toml"
RECORDS = ROOT / "studies" / "where_to_branch_records.jsonl"
FINISH = "python -m studies.where_to_branch run --arms {arms} --block {block} --sft-seed {sft_seed} --sft DIR"
PLAN: dict[str, Any] = {
    "date": "2026-12-07",
    "setting": FILE,
    "eval_tasks": 258,
    "distinct_tasks": 256,
    "eval_every": 2,
    "endpoint_iterations": (4, 6),
    "precision": "fp32",
    "arms": ("entropy", "random", "grpo"),
    "secondary_arms": ("appo",),
    "primary": ("entropy", "random"),
    "contrasts": (("entropy", "random"), ("entropy", "grpo"), ("random", "grpo")),
    "alpha": 0.05,
    "power": 0.8,
    "effect": 0.10,
    "pilot_blocks": 5,
    "pilot_counts": True,
    "min_blocks": 7,
    "match_tolerance": 0.10,
    "budget_hours": 8,
}
#: Shared by every arm: the held-out protocol of the endpoint and the fixed precision.
COMMON = [
    f"evaluation.every={PLAN['eval_every']}",
    f"evaluation.num_prompts={PLAN['eval_tasks']}",
    'evaluation.split="test"',
    "evaluation.samples=1",
    "evaluation.temperature=0.0",
    f'training.precision="{PLAN["precision"]}"',
    'rollouts.dtype="float32"',
]
#: The training code a record depends on; its git tree hashes make the record's ``code``.
CODE_PATHS = ("arpo_algo", "arpo_env", "arpo_base", "pyproject.toml", FILE)
#: Settings fixed after the plan and before any run that uses them, dated; the plan itself is never edited. An entry
#: may set ``random_rate`` (the random arm's p: the entropy arm's branches per opportunity, measured on the pilot's
#: SFT checkpoint), ``appo_threshold`` (the secondary arm's threshold at the same count) or ``blocks`` (the n the
#: pilot gave, or the blocks the time allows); the last entry that sets a key is in force.
DEVIATIONS: tuple[dict[str, Any], ...] = ()


def fixed(key: str) -> Any:
    """The value of ``key`` in force (the last deviation that sets it), or None if none has."""
    return next((d[key] for d in reversed(DEVIATIONS) if key in d), None)


def arm_spec(arm: str) -> tuple[str, list[str]]:
    """(experiment file, overrides) of an arm; ConfigError for an unknown arm or one whose rate is not recorded yet."""
    if arm == "entropy":
        return FILE, list(COMMON)
    if arm == "grpo":
        return FILE, [*COMMON, 'experiment.algorithm="grpo"', "tree.initial=8", "tree.branch_factor=0"]
    if arm in ("random", "appo"):
        key = "random_rate" if arm == "random" else "appo_threshold"
        value = fixed(key)
        if value is None:
            raise ConfigError(
                f"the {arm} arm has no {key} recorded",
                hint=f"measure it (the pilot's first step, studies/where_to_branch_plan.md) and record it as a dated "
                f"entry of DEVIATIONS in studies/where_to_branch.py before any {arm} run",
            )
        extra = ["tree.random_lookahead=true", f"tree.random_rate={value}"] if arm == "random" else []
        return FILE, [*COMMON, f'tree.branch_policy="{arm}"', *extra] + (
            [f"tree.appo_threshold={value}"] if arm == "appo" else []
        )
    raise ConfigError(f"unknown arm {arm!r}", hint=f"one of {', '.join(PLAN['arms'] + PLAN['secondary_arms'])}")


def check_arms(specs: dict[str, tuple[str, list[str]]]) -> dict[str, Any]:
    """Load every arm's experiment and refuse a design whose arms differ in budget (``studies.compare``'s
    ``BUDGET_FIELDS``) or in any optimizer, rollout or evaluation setting: the arms differ in the tree alone."""
    from arpo_algo.run.experiment import load_experiment

    exps = {arm: load_experiment(str(ROOT / file), overrides) for arm, (file, overrides) in specs.items()}
    check_equal_budget(exps)
    for section in ("training", "rollouts", "evaluation"):
        values = {arm: dataclasses.asdict(getattr(e.config.settings, section)) for arm, e in exps.items()}
        first = next(iter(values.values()))
        for arm, v in values.items():
            diff = sorted(k for k in v if v[k] != first.get(k))
            if diff:
                raise ConfigError(
                    f"arm {arm} differs from the others in [{section}] {', '.join(diff)}",
                    hint="the arms of this study differ only in where the tree branches",
                )
    return exps


def cpu_flags() -> list[str]:
    """The CPU's AVX-512 and AMX flags (/proc/cpuinfo): what decides which kernels the float arithmetic takes."""
    from arpo_algo.rollout.engines.vllm.support import read_cpu_flags

    return sorted(f for f in (read_cpu_flags() or ()) if f.startswith(("avx512", "amx")))


def endpoint(record: dict[str, Any]) -> float:
    """The mean held-out accuracy of the evaluations after the plan's endpoint iterations (read from the record's
    curve alone; its arm, if any, only names it in an error)."""
    acc = {int(it): a for it, *_, a in record["curve"]}
    missing = [i for i in PLAN["endpoint_iterations"] if i not in acc]
    if missing:
        raise ConfigError(
            f"the {record.get('arm', 'unlabelled')} record of block {record['block']['id']} has no evaluation after "
            f"iteration(s) {missing}",
            hint=f"the plan evaluates every {PLAN['eval_every']} iterations: the record is not from this study",
        )
    return sum(acc[i] for i in PLAN["endpoint_iterations"]) / len(PLAN["endpoint_iterations"])


def blinded_sd(blocks: dict[int, list[dict[str, Any]]]) -> float:
    """The sd of a paired difference, estimated without arm labels: the within-block variance of the endpoint,
    pooled over blocks (weighted by degrees of freedom), times 2. The arms' true differences add to the within-block
    spread, so the estimate is conservative (too large) when the arms differ. Reads no record's ``arm``."""
    ss, df = 0.0, 0
    for rs in blocks.values():
        ys = [endpoint({"curve": r["curve"], "block": r["block"]}) for r in rs]
        m = sum(ys) / len(ys)
        ss += sum((y - m) ** 2 for y in ys)
        df += len(ys) - 1
    if df == 0:
        raise ConfigError("the pilot needs at least one complete block with two arms")
    return math.sqrt(2 * ss / df)


def rejects(diffs: list[float], crit: int) -> bool:
    """The exact two-sided Wilcoxon test for untied, non-zero differences: min(W+, W-) <= ``crit``."""
    order = sorted(range(len(diffs)), key=lambda i: abs(diffs[i]))
    w_plus = sum(rank for rank, i in enumerate(order, 1) if diffs[i] > 0)
    total = len(diffs) * (len(diffs) + 1) // 2
    return min(w_plus, total - w_plus) <= crit


def critical(n: int, alpha: float) -> int:
    """The largest rank sum c with 2 P(W+ <= c) < alpha under the null of n untied ranks (-1: none)."""
    counts, c, cum = _null_counts(n), -1, 0
    while 2 * (cum + counts[c + 1]) < alpha * 2**n:
        c += 1
        cum += counts[c]
    return c


def blocks_for_power(sd: float, effect: float, alpha: float, power: float, sims: int = 1000, n_max: int = 400) -> int:
    """The smallest number of blocks at which the exact Wilcoxon test at ``alpha`` rejects with at least ``power``
    when the paired differences are normal with mean ``effect`` and sd ``sd`` (seeded simulation); n_max + 1 when
    none up to ``n_max`` does."""
    rng = random.Random(0)
    for n in range(PLAN["pilot_blocks"], n_max + 1):
        crit = critical(n, alpha)
        if crit >= 0 and sum(rejects([rng.gauss(effect, sd) for _ in range(n)], crit) for _ in range(sims)) >= (
            power * sims
        ):
            return n
    return n_max + 1


def holm(ps: dict[Any, float]) -> dict[Any, float]:
    """Holm's step-down adjusted p-values: the k-th smallest p times (m - k + 1), made monotone, capped at 1."""
    out, running = {}, 0.0
    for k, (key, p) in enumerate(sorted(ps.items(), key=lambda kv: kv[1])):
        running = max(running, min(1.0, (len(ps) - k) * p))
        out[key] = running
    return out


def plan_text() -> str:
    p = PLAN
    lines = [
        f"Where to branch: the plan fixed on {p['date']} (studies/where_to_branch_plan.md)",
        f"setting: {p['setting']}; precision {p['precision']}; arms {', '.join(p['arms'])} "
        f"(secondary: {', '.join(p['secondary_arms'])}, once its threshold is recorded)",
        f"endpoint: mean held-out accuracy after iterations {' and '.join(map(str, p['endpoint_iterations']))} (the "
        f"last two evaluations, every {p['eval_every']}), greedy, one sample, on the first {p['eval_tasks']} "
        f"ToolMath level-3 test tasks ({p['distinct_tasks']} distinct questions)",
        f"contrasts: {', '.join(f'{a} - {b}' for a, b in p['contrasts'])} (primary: "
        f"{' - '.join(p['primary'])}); Holm-adjusted over the {len(p['contrasts'])} at alpha = {p['alpha']}",
        "test: exact two-sided Wilcoxon signed-rank over blocks (zeros dropped, average ranks for ties); estimate: "
        "Hodges-Lehmann with its exact interval",
        f"n: {p['pilot_blocks']} pilot blocks estimate the sd of a paired difference blind to arms; n = the blocks "
        f"for {p['power']:.0%} power against a mean difference of {p['effect']} at alpha / "
        f"{len(p['contrasts'])} (Holm's first step), at least {p['min_blocks']}; the pilot blocks "
        f"{'count' if p['pilot_counts'] else 'do not count'}; if n blocks do not fit in {p['budget_hours']} "
        "hours of the machine, as many as fit, said so, with the interval reached",
        f"random arm: matched when its branches per group lie within {p['match_tolerance']:.0%} of the entropy arm's",
    ]
    for arm in (*p["arms"], *p["secondary_arms"]):
        try:
            file, overrides = arm_spec(arm)
            lines.append(f"arm {arm}: {file} --set {' --set '.join(overrides)}")
        except ConfigError as e:
            lines.append(f"arm {arm}: not yet runnable ({str(e).splitlines()[0]})")
    lines += [f"deviation recorded {d['date']}: {json.dumps(d)}" for d in DEVIATIONS]
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    arms = list(dict.fromkeys(args.arms))
    if len(arms) < 2:
        raise ConfigError("a block pairs arms: name at least two", hint=f"the plan's arms: {' '.join(PLAN['arms'])}")
    specs = {arm: arm_spec(arm) for arm in arms}
    check_arms(specs)
    code, commit = code_hash(allow_dirty=args.dry_run, paths=CODE_PATHS)
    sft_hash, here, flags = file_hash(args.sft), machine(), cpu_flags()
    records = read_records(args.records)
    seed = args.block  # the RL seed of every arm of the block
    check_block(records, args.block, args.sft_seed, sft_hash, arms, [seed])
    for r in records:
        block = r["block"]["id"] == args.block
        checks = [("code", code)] + ([("sft", sft_hash), ("cpu_flags", flags), ("torch", here["torch"])] * block)
        for key, mine in checks:
            if r[key] != mine:
                raise ConfigError(
                    f"block {r['block']['id']}'s records in {args.records} come from {key} {r[key]}, this run "
                    f"would be {mine}",
                    hint="every block runs the pinned commit; a block's arms run from one checkpoint on one CPU kind",
                )
    done = {r["arm"] for r in records if r["block"]["id"] == args.block}
    out = args.output / f"block_{args.block}"
    todo = [arm for arm in arms if arm not in done]
    print(
        f"[where] block {args.block} (SFT seed {args.sft_seed}, SFT {sft_hash}), code {code}, CPU flags "
        f"{' '.join(flags) or 'none'}: {len(todo)} run(s)",
        flush=True,
    )
    if args.dry_run:
        for arm in todo:
            print(f"[where] would run {arm} seed {seed} into {out / arm}: {' '.join(specs[arm][1])}", flush=True)
        return 0
    design = {"id": args.block, "sft_seed": args.sft_seed, "arms": sorted(arms), "seeds": [seed]}
    for arm in todo:
        print(f"[where] {arm} block {args.block} ...", flush=True)
        got = run_arm(arm, seed, args.sft.resolve(), out / arm, not args.no_progress, spec=specs[arm])
        rec = {"arm": arm, "seed": seed, "code": code, "commit": commit, "sft": sft_hash, **here}
        rec.update(cpu_flags=flags, threads=args.threads, date=time.strftime("%Y-%m-%d"), overrides=specs[arm][1])
        rec.update(got, block=design)
        rec["endpoint"] = endpoint(rec)
        with args.records.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())  # the record is on disk before its run's checkpoints may go
        # no accuracy is printed: the plan keeps the arms' results unseen until the study closes
        print(f"[where] {arm} block {args.block}: recorded in {got['time_s']:.0f} s", flush=True)
        if not args.keep_checkpoints:
            drop_checkpoints(out / arm)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    """A block's SFT checkpoint: the quickstart's pull and SFT stages with ``--sft-seed``, into ``<output>/sft``. The
    folder keeps the quickstart's stage markers, so a finished stage is reused only for the same seed."""
    import functools

    from arpo_algo.models import pull
    from arpo_algo.run.quickstart import MODEL, run_stage, stage_inputs, stage_sft

    out = args.output.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    pulled = run_stage(out, "pull", lambda: {"path": str(pull(MODEL, progress=progress))}, stage_inputs("pull"))
    make = functools.partial(stage_sft, out, pulled["path"], args.sft_seed, progress, PLAN["precision"])
    sft = run_stage(out, "sft", make, stage_inputs("sft", args.sft_seed, PLAN["precision"]))
    print(f"[where] SFT seed {args.sft_seed}: {sft['path']} (use it as --sft with --sft-seed {args.sft_seed})")
    return 0


def cmd_pilot(args: argparse.Namespace) -> int:
    blocks = complete_blocks(read_records(args.records), FINISH)
    pilot = dict(sorted(blocks.items())[: PLAN["pilot_blocks"]])
    if len(pilot) < PLAN["pilot_blocks"]:
        print(f"note: {len(pilot)} of the {PLAN['pilot_blocks']} pilot blocks are complete")
    sd = blinded_sd(pilot)
    alpha = PLAN["alpha"] / len(PLAN["contrasts"])
    n = max(PLAN["min_blocks"], blocks_for_power(sd, PLAN["effect"], alpha, PLAN["power"]))
    print(
        f"pilot blocks {', '.join(map(str, pilot))}: sd of a paired difference (blind, pooled within blocks, x sqrt 2) "
        f"= {sd:.4f}\nn = {n} blocks for {PLAN['power']:.0%} power against {PLAN['effect']} at alpha {alpha:.4f} "
        f"(exact Wilcoxon, 1000 seeded simulations; at least {PLAN['min_blocks']})"
    )
    return 0


def report(records: list[dict[str, Any]]) -> str:
    """The per-contrast table from complete blocks: paired differences by block, mean, Hodges-Lehmann estimate and
    exact interval, exact Wilcoxon p and Holm-adjusted p; then branches per group per arm and the random arm's match."""
    blocks = complete_blocks(records, FINISH)
    n = fixed("blocks")
    if n is not None:  # the analysis is of the first n blocks the plan's deviation fixes
        blocks = dict(sorted(blocks.items())[:n])
    y = {(r["arm"], b): endpoint(r) for b, rs in blocks.items() for r in rs}
    explore = [("appo", other) for other in ("entropy", "random", "grpo")]
    rows, ps = [], {}
    for a, b in [*PLAN["contrasts"], *explore]:
        ids = sorted(k for k in blocks if (a, k) in y and (b, k) in y)
        d = [y[(a, k)] - y[(b, k)] for k in ids]
        if not d:
            continue
        est, lo, hi, cov = hodges_lehmann(d, PLAN["alpha"])
        ps[(a, b)] = wilcoxon(d)[0]
        rows.append((a, b, ids, d, est, lo, hi, cov))
    adj = holm({c: p for c, p in ps.items() if c in PLAN["contrasts"]})
    lines = [
        f"blocks: {len(blocks)} complete ({'n not fixed yet' if n is None else f'planned n = {n}'}); endpoint: mean "
        f"accuracy after iterations {' and '.join(map(str, PLAN['endpoint_iterations']))}",
        "",
        "| contrast | blocks | differences by block | mean | Hodges-Lehmann | exact interval | p | Holm p |",
        "|" + "---|" * 8,
    ]
    for a, b, ids, d, est, lo, hi, cov in rows:
        label = " (primary)" if (a, b) == PLAN["primary"] else "" if (a, b) in adj else " (exploratory)"
        lines.append(
            f"| {a} - {b}{label} | {len(ids)} | {' '.join(f'{k}:{x:+.3f}' for k, x in zip(ids, d))} | "
            f"{stats(d)['mean']:+.4f} | {est:+.4f} | {lo:+.4f} .. {hi:+.4f} ({cov:.1%}) | {ps[(a, b)]:.4f} | "
            f"{f'{adj[(a, b)]:.4f}' if (a, b) in adj else '-'} |"
        )
    per_arm: dict[str, list[float]] = {}
    for rs in blocks.values():
        for r in rs:
            per_arm.setdefault(r["arm"], []).append(r["branches_per_group"])
    lines += ["", "| arm | blocks | endpoint mean | branches per group |", "|---|---|---|---|"]
    for arm, bpg in per_arm.items():
        ends = [v for (a2, _), v in y.items() if a2 == arm]
        lines.append(f"| {arm} | {len(bpg)} | {stats(ends)['mean']:.4f} | {stats(bpg)['mean']:.3f} |")
    if {"entropy", "random"} <= per_arm.keys():
        e, r = stats(per_arm["entropy"])["mean"], stats(per_arm["random"])["mean"]
        if e:  # the gap is relative to the entropy arm's count, which has no scale when it never branched
            gap = abs(r - e) / e
            verdict = f"{gap:.1%} apart: {'matched' if gap <= PLAN['match_tolerance'] else 'NOT matched'}"
        else:
            verdict = "the entropy arm never branched: no match to judge"
        lines.append(
            f"\nrandom against entropy: branches per group {r:.3f} against {e:.3f}, {verdict} "
            f"(tolerance {PLAN['match_tolerance']:.0%})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", help="print the fixed plan and the arms")
    sft = sub.add_parser("sft", help="build a block's SFT checkpoint (the quickstart's SFT stage with its own seed)")
    sft.add_argument("--sft-seed", type=int, required=True, help="the SFT seed (one per block)")
    sft.add_argument("--output", type=Path, required=True, help="folder; the checkpoint is written to <output>/sft")
    sft.add_argument("--no-progress", action="store_true")
    run = sub.add_parser("run", help="train every arm of one block from its SFT checkpoint")
    run.add_argument("--block", type=int, required=True, help="the block number (also the RL seed of its arms)")
    run.add_argument("--sft-seed", type=int, required=True, help="the SFT seed the --sft checkpoint was built with")
    run.add_argument("--sft", type=Path, required=True, help="the block's SFT checkpoint (a quickstart sft folder)")
    run.add_argument("--arms", nargs="+", default=list(PLAN["arms"]), help="default: the plan's arms")
    run.add_argument("--records", type=Path, default=RECORDS)
    run.add_argument("--output", type=Path, default=Path("runs/where_to_branch"), help="run folders (not kept)")
    run.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    run.add_argument("--dry-run", action="store_true", help="check everything and list the runs; write nothing")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--keep-checkpoints", action="store_true", help="keep each finished run's checkpoints")
    for name, text in (("pilot", "the blind spread and the n it gives"), ("report", "the contrasts' table")):
        sub.add_parser(name, help=text).add_argument("--records", type=Path, default=RECORDS)
    args = ap.parse_args(argv)
    try:
        if args.command == "plan":
            print(plan_text())
            return 0
        if args.command == "report":
            print(report(read_records(args.records)))
            return 0
        if args.command in ("run", "sft"):
            import torch

            torch.set_num_threads(getattr(args, "threads", 1))
        return {"run": cmd_run, "sft": cmd_sft, "pilot": cmd_pilot}[args.command](args)
    except ArpoError as e:
        print(f"error: {e}" + (f"\nhint: {e.hint}" if getattr(e, "hint", None) else ""), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
