"""The powered comparison: ARPO against GRPO (and AEPO) over many paired seeds, run as a resumable study.

    python -m studies.study plan
    python -m studies.study run arpo grpo --seeds 0-15 --sft runs/quickstart/sft --records FILE
    python -m studies.study run arpo grpo --seeds 0-7 --block 1 --sft-seed 1 --sft SFT1 [--dry-run]
    python -m studies.study report --records FILE [--figures DIR] [--arms ARM ...]

The analysis is fixed before any run (``plan`` prints it; docs/results/powered-comparison.md states it): the primary
test is the two-sided Wilcoxon signed-rank test on the paired final held-out accuracies of ARPO and GRPO (same seed,
same SFT checkpoint, same machine kind), at n = 16 pairs, alpha = 0.05.

Every arm is an experiment file plus fixed overrides (``ARMS``): held-out accuracy on 128 test tasks after every
iteration, AEPO with 4 mini-batches so that its clipping can act. A finished run becomes one JSON line in the records
file: the arm, the seed, the code it ran (a hash of the training code's git trees, so that every record of a study comes
from one pinned commit), the SFT weights' hash, the CPU, the library versions, the held-out curve with the cumulative
tool calls and generated tokens, and the diagnostics. The records are the study's results and are kept in the
repository (``studies/study_records.jsonl``); run folders are not. ``run`` skips every (arm, seed) already
recorded, so the study continues after an interruption, or later from a fresh clone of the pinned commit
(a run killed mid-way resumes from its newest checkpoint if its folder is still there). It refuses to add records made
by other code, another SFT checkpoint or another kind of CPU than the records already hold.

A block (``--block B --sft-seed S``) is a set of pairs from its own SFT checkpoint: its records carry the block's
design, every arm and seed of it runs from that checkpoint on one kind of machine in one invocation, no two blocks
share an SFT seed or checkpoint, and a partial block is refused by ``run`` and by ``report`` (which reports each block
as a labelled side analysis, paired within the block). So no study depends on rebuilding weights bit for bit on
another CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from arpo_algo.rollout import diagnostics as D
from arpo_algo.rollout import metrics as MK
from arpo_base.errors import ArpoError, ConfigError
from studies.compare import collect
from studies.study_report import planned_test, power_mde, report

ROOT = Path(__file__).resolve().parent.parent
EVAL = ["evaluation.every=1", "evaluation.num_prompts=128", 'evaluation.split="test"']
QS_EVAL = ["evaluation.every=6", "evaluation.num_prompts=128", 'evaluation.split="test"']  # before and after
QUICKSTART = "arpo_algo/run/recipes/quickstart.toml"
#: arm -> (experiment file, overrides). The M = 8 / N = 4 budget: 4 prompts per step, 6 iterations.
ARMS: dict[str, tuple[str, list[str]]] = {
    "arpo": ("experiments/comparisons/compare_arpo_m8.toml", EVAL),
    "grpo": ("experiments/comparisons/compare_grpo_m8.toml", EVAL),
    # 4 prompts per step in 4 mini-batches: from the second optimizer step on the ratio moves, so clipping can act
    "aepo": ("experiments/comparisons/compare_aepo_m8.toml", [*EVAL, "training.mini_batches=4"]),
    # the quickstart's default number of mini-batches, chosen by this measurement
    "quickstart_mb1": (QUICKSTART, ["training.mini_batches=1", *QS_EVAL]),
    "quickstart_mb4": (QUICKSTART, ["training.mini_batches=4", *QS_EVAL]),
    # asynchronous rollouts against synchronous ones at the quickstart budget: both sample on one rollout actor, so
    # the pipeline's staleness is the only difference between the arms
    "qs_sync": (QUICKSTART, ["rollouts.num_rollout_actors=1", *QS_EVAL]),
    "qs_async": (QUICKSTART, ["rollouts.num_rollout_actors=1", "rollouts.asynchronous=true", *QS_EVAL]),
}
#: The training code a record depends on; its git tree hashes make the record's ``code``.
CODE_PATHS = (
    "arpo_algo",
    "arpo_env",
    "arpo_base",
    "pyproject.toml",
    "experiments/comparisons/compare_arpo_m8.toml",
    "experiments/comparisons/compare_grpo_m8.toml",
    "experiments/comparisons/compare_aepo_m8.toml",
)
PLAN = {
    "primary": "two-sided Wilcoxon signed-rank test (zero differences dropped, exact null distribution with "
    "average ranks for ties) on paired final held-out accuracy, ARPO - GRPO",
    "pairs": 16,
    "alpha": 0.05,
    "aepo_seeds": 8,
    "eval_tasks": 128,
    "pilot_sd": 0.246,
}  # sd of the paired differences of the 5-seed pilot at M = 8 (docs/results/arpo-vs-grpo.md)
#: Departures from ``PLAN``, dated and recorded before any run or analysis that depends on them. The primary test is
#: run at the last entry's ``pairs`` over the first that many paired seeds; the plan itself is never edited.
DEVIATIONS: tuple[dict[str, Any], ...] = (
    {
        "date": "2026-11-28",
        "pairs": 14,
        "aepo_seeds": 0,
        "reason": "the study stops at 14 pairs (seeds 0-13) for a hardware reason: its SFT checkpoint is rebuilt bit "
        "for bit only on the kind of CPU that made it, so the remaining pairs cannot come from the same "
        "checkpoint elsewhere. The planned test is reported at n = 14, with its power; the AEPO seeds are "
        "not run. Pairs from a new SFT checkpoint may only be added as a labelled side analysis, in blocks.",
    },
)


def code_hash(allow_dirty: bool = False, paths: tuple[str, ...] = CODE_PATHS) -> tuple[str, str]:
    """(hash of the git trees of ``paths`` at HEAD, HEAD's commit); ConfigError if those paths have local edits
    (``allow_dirty``: only for a dry run, which writes no record). The default paths are this study's training code;
    another study names its own experiment files."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", *paths)
    if dirty and not allow_dirty:
        raise ConfigError(
            f"the training code has uncommitted changes:\n{dirty}",
            hint="a study's records must come from one commit: run it from a clean checkout",
        )
    trees = [git("rev-parse", f"HEAD:{p}") for p in paths]
    return hashlib.sha256(" ".join(trees).encode()).hexdigest()[:16], git("rev-parse", "HEAD")


def file_hash(folder: Path) -> str:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} holds no *.safetensors weights", hint="--sft is the quickstart's sft folder")
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def machine() -> dict[str, Any]:
    import torch
    import transformers

    from arpo_algo.rollout.engines.vllm.support import cpu_features

    flags = sorted(f for f, present in cpu_features().items() if present)
    return {
        "cpu": f"{platform.machine()} {'/'.join(flags) or 'no vector flags'}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def parse_seeds(spec: list[str]) -> list[int]:
    seeds: list[int] = []
    for s in spec:
        lo, _, hi = s.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ConfigError(f"--seeds takes numbers and ranges like 0-15, got {s!r}")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


def run_arm(
    arm: str, seed: int, sft: Path, out: Path, progress: bool, spec: tuple[str, list[str]] | None = None
) -> dict[str, Any]:
    """Train one (arm, seed) into ``out`` (resuming its newest checkpoint if there is one) and collect its figures;
    ``spec``: the arm's (experiment file, overrides) where another study defines it (default: ``ARMS[arm]``)."""
    from arpo_algo.models.checkpoints import list_checkpoints
    from arpo_algo.run.driver import read_metrics, train_experiment
    from arpo_algo.run.experiment import load_experiment

    file, overrides = spec if spec is not None else ARMS[arm]
    exp = load_experiment(
        str(ROOT / file), [f"model.path={json.dumps(str(sft))}", *overrides, f"experiment.seed={seed}"]
    )
    resumed = bool(list_checkpoints(out / "checkpoints"))
    t0 = time.time()
    summary = train_experiment(exp, output=None if resumed else out, resume=out if resumed else None, progress=progress)
    got = collect(out, summary["accuracy_before"], summary["accuracy_after"], time.time() - t0)
    rows = {r["iteration"]: r for r in read_metrics(out / "metrics.jsonl")}
    curve = [
        [it, calls, sum(rows[i].get(MK.TOKENS_GENERATED, 0.0) for i in rows if 0 < i <= it), acc]
        for it, calls, acc in got["curve"]
    ]  # (iteration, cumulative tool calls, cumulative tokens, accuracy)
    train = [r for i, r in sorted(rows.items()) if i > 0]
    return {
        "before": got["before"],
        "after": got["after"],
        "curve": curve,
        "tool_calls": got["tool_calls"],
        "tokens": got["tokens"],
        "branches_per_group": _mean(r.get(D.BRANCHES_PER_GROUP, 0.0) for r in train),
        "clip_frac": _mean(r.get(D.CLIP_FRAC, 0.0) for r in train),
        "zero_variance": _mean(r.get(D.ZERO_VARIANCE_GROUP_FRAC, 0.0) for r in train),
        "staleness_max": max((r.get(MK.STALENESS_MAX, 0.0) for r in train), default=0.0),
        "skipped": got["skipped"],
        "time_s": round(got["time_s"], 1),
        "resumed": resumed,
    }


def _mean(xs: Any) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def check_block(
    records: list[dict[str, Any]], block: int, sft_seed: int, sft_hash: str, arms: list[str], seeds: list[int]
) -> None:
    """Refuse a block run that would break a block's invariants: every (arm, seed) of a block comes from the block's
    own SFT checkpoint (its own SFT seed and weights' hash, shared with no other block) on one kind of machine, and
    one invocation runs the block's whole design (every arm of every seed), so no block is split across checkpoints,
    machines or arm subsets. The code, CPU and torch checks of ``cmd_run`` apply within the block."""
    design = {"arms": sorted(arms), "seeds": sorted(seeds)}
    for r in records:
        b = r.get("block")
        if b is None:
            if r["sft"] == sft_hash:
                raise ConfigError(
                    f"block {block}'s SFT checkpoint {sft_hash} is the main study's",
                    hint="a block starts from its own SFT checkpoint: build one with another --sft-seed",
                )
        elif b["id"] != block and (b["sft_seed"] == sft_seed or r["sft"] == sft_hash):
            raise ConfigError(
                f"block {b['id']} already uses SFT seed {b['sft_seed']} (hash {r['sft']}); block "
                f"{block} would use SFT seed {sft_seed} (hash {sft_hash})",
                hint="each block has its own SFT seed and checkpoint",
            )
        elif b["id"] == block and (b["sft_seed"], {"arms": b["arms"], "seeds": b["seeds"]}) != (sft_seed, design):
            raise ConfigError(
                f"block {block} was started as SFT seed {b['sft_seed']}, arms {' '.join(b['arms'])}, "
                f"seeds {b['seeds']}; this run asks for SFT seed {sft_seed}, arms {' '.join(arms)}, "
                f"seeds {sorted(seeds)}",
                hint="a partial block is refused: run the block's whole design in one invocation",
            )


def cmd_run(args: argparse.Namespace) -> int:
    for arm in args.arms:
        if arm not in ARMS:
            raise ConfigError(f"unknown arm {arm!r}", hint=f"one of {', '.join(ARMS)}")
    if (args.block is None) != (args.sft_seed is None):
        raise ConfigError(
            "--block and --sft-seed go together",
            hint="a block is named by its number and the SFT "
            "seed its checkpoint was built with (python -m arpo_algo.run.quickstart --sft-seed S)",
        )
    code, commit = code_hash(allow_dirty=args.dry_run)
    sft_hash, here = file_hash(args.sft), machine()
    records = read_records(args.records)
    seeds = parse_seeds(args.seeds)
    if args.block is not None:
        if len(args.arms) < 2:
            raise ConfigError(f"block {args.block} names one arm", hint="a block pairs arms: name every arm of it")
        check_block(records, args.block, args.sft_seed, sft_hash, args.arms, seeds)
    # the records a run must agree with: its block's, or the main study's
    peers = [r for r in records if (r.get("block") or {}).get("id") == args.block]
    for r in peers[:1]:
        for key, mine in (("code", code), ("sft", sft_hash), ("cpu", here["cpu"]), ("torch", here["torch"])):
            if r[key] != mine:
                raise ConfigError(
                    f"the records in {args.records} come from {key} {r[key]}, this run would be {mine}",
                    hint="continue the study from its pinned commit, SFT checkpoint and "
                    "kind of CPU (see the records' first line), or start a new records file",
                )
    done = {(r["arm"], r["seed"]) for r in peers}
    if args.block is not None:
        args.output = args.output / f"block_{args.block}"
    if args.dry_run:
        todo = [(arm, seed) for seed in seeds for arm in args.arms if (arm, seed) not in done]
        print(
            f"[study] dry run: {len(todo)} run(s) from SFT {sft_hash} on {here['cpu']}, code {code}"
            + ("" if args.block is None else f", block {args.block} (SFT seed {args.sft_seed})"),
            flush=True,
        )
        for arm, seed in todo:
            print(f"[study] would run {arm} seed {seed} into {args.output / arm / f'seed_{seed}'}", flush=True)
        return 0
    for arm, seed in sorted(done):  # a stop between a record and its cleanup left these behind
        folder = args.output / arm / f"seed_{seed}"
        # result.json: the run finished (a live run of the same seed in this folder, from another records file,
        # has none yet)
        if (
            arm in args.arms
            and not args.keep_checkpoints
            and (folder / "checkpoints").is_dir()
            and (folder / "result.json").is_file()
        ):
            freed = drop_checkpoints(folder)
            print(
                f"[study] {arm} seed {seed} is recorded: dropped its checkpoints ({freed / 2**30:.1f} GiB)", flush=True
            )
    block = (
        None
        if args.block is None
        else {"id": args.block, "sft_seed": args.sft_seed, "arms": sorted(args.arms), "seeds": sorted(seeds)}
    )
    for seed in seeds:
        for arm in args.arms:
            if (arm, seed) in done:
                continue
            print(f"[study] {arm} seed {seed} ...", flush=True)
            got = run_arm(arm, seed, args.sft.resolve(), args.output / arm / f"seed_{seed}", not args.no_progress)
            rec = {
                "arm": arm,
                "seed": seed,
                "code": code,
                "commit": commit,
                "sft": sft_hash,
                **here,
                "threads": args.threads,
                "date": time.strftime("%Y-%m-%d"),
                **got,
            }
            if block is not None:
                rec["block"] = block
            with args.records.open("a") as f:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())  # the record is on disk before its run's checkpoints may go
            print(
                f"[study] {arm} seed {seed}: {got['before']:.3f} -> {got['after']:.3f} in {got['time_s']:.0f} s",
                flush=True,
            )
            if not args.keep_checkpoints:
                freed = drop_checkpoints(args.output / arm / f"seed_{seed}")
                print(f"[study] {arm} seed {seed}: dropped its checkpoints ({freed / 2**30:.1f} GiB)", flush=True)
    return 0


def drop_checkpoints(out: Path) -> int:
    """Delete a finished run's ``checkpoints/`` folder and return the bytes freed.

    Only called once the run's record is on disk: the record is the study's result, and a checkpoint (weights plus
    optimizer state, 1.6 GB for SmolLM2-135M) per finished run would fill a disk over a 40-run study. The run's
    metrics, config and result files stay."""
    ckpts = out / "checkpoints"
    if not ckpts.is_dir():
        return 0
    freed = sum(f.stat().st_size for f in ckpts.rglob("*") if f.is_file())
    shutil.rmtree(ckpts)
    return freed


def cmd_plan(args: argparse.Namespace) -> int:
    mde = power_mde(PLAN["pairs"], PLAN["pilot_sd"], PLAN["alpha"])
    print(
        f"primary test: {PLAN['primary']}\nn = {PLAN['pairs']} pairs, alpha = {PLAN['alpha']}; AEPO over "
        f"{PLAN['aepo_seeds']} seeds; held-out accuracy on {PLAN['eval_tasks']} test tasks after every iteration\n"
        f"power: with paired differences of sd {PLAN['pilot_sd']} (the pilot), {PLAN['pairs']} pairs detect a mean "
        f"difference of {mde:.2f} with 80% power (Wilcoxon, simulated)"
    )
    for arm, (file, overrides) in ARMS.items():
        print(f"arm {arm}: {file} --set {' --set '.join(overrides)}")
    for d in DEVIATIONS:
        print(f"deviation recorded {d['date']}: n = {d['pairs']} pairs, {d['aepo_seeds']} AEPO seeds; {d['reason']}")
    return 0


#: How a partial block is finished, for the hint of :func:`complete_blocks` (another study passes its own).
FINISH_BLOCK = "python -m studies.study run {arms} --block {block} --sft-seed {sft_seed} ..."


def complete_blocks(records: list[dict[str, Any]], finish: str = FINISH_BLOCK) -> dict[int, list[dict[str, Any]]]:
    """The records of each block by its id; ConfigError naming the missing runs of a partial block, whose pairs would
    otherwise enter an analysis without the arms they are paired with (``finish``: the command the hint gives)."""
    blocks: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("block"):
            blocks.setdefault(r["block"]["id"], []).append(r)
    for bid, rs in sorted(blocks.items()):
        design = rs[0]["block"]
        have = {(r["arm"], r["seed"]) for r in rs}
        missing = [
            f"{arm} seed {seed}" for seed in design["seeds"] for arm in design["arms"] if (arm, seed) not in have
        ]
        if missing:
            how = finish.format(arms=" ".join(design["arms"]), block=bid, sft_seed=design["sft_seed"])
            raise ConfigError(
                f"block {bid} is partial: no record of {', '.join(missing)}",
                hint=f"finish it ({how}) before reporting",
            )
    return blocks


def cmd_report(args: argparse.Namespace) -> int:
    records = read_records(args.records)
    blocks = complete_blocks(records)
    records = [r for r in records if not r.get("block")]  # the main study; blocks are side analyses
    if args.arms:
        unknown = sorted(set(args.arms) - {r["arm"] for r in records})
        if unknown:
            raise ConfigError(
                f"no record of the arm(s) {', '.join(unknown)} in {args.records}",
                hint=f"--arms takes some of {', '.join(sorted({r['arm'] for r in records}))}",
            )
        records = [r for r in records if r["arm"] in args.arms]
    if records and args.baseline not in {r["arm"] for r in records}:
        raise ConfigError(
            f"no record of the baseline arm {args.baseline!r} in {args.records}",
            hint=f"--baseline is one of {', '.join(sorted({r['arm'] for r in records}))}",
        )
    arms = {r["arm"] for r in records}
    if {"arpo", "grpo"} <= arms:
        dev = DEVIATIONS[-1] if DEVIATIONS else {"pairs": PLAN["pairs"], "aepo_seeds": PLAN["aepo_seeds"]}
        effect = power_mde(PLAN["pairs"], PLAN["pilot_sd"], PLAN["alpha"])  # the effect the plan was sized for
        print(
            planned_test(
                records,
                dev["pairs"],
                PLAN["alpha"],
                effect,
                PLAN["pilot_sd"],
                PLAN["pairs"],
                dev["aepo_seeds"],
                PLAN["aepo_seeds"],
            )
            + "\n"
        )
    print(report(records, args.figures, baseline=args.baseline))
    for bid, rs in sorted(blocks.items()):
        rs = [r for r in rs if not args.arms or r["arm"] in args.arms]
        if not rs:
            continue
        print(
            f"\nSide analysis, not the planned test: block {bid} (SFT seed {rs[0]['block']['sft_seed']}, "
            f"SFT {rs[0]['sft']}), paired within the block\n"
        )
        print(report(rs, baseline=args.baseline))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", help="print the fixed analysis plan and the arms")
    run = sub.add_parser("run", help="train every (arm, seed) not in the records yet, seed-major")
    run.add_argument("arms", nargs="+", help=f"arms: {', '.join(ARMS)}")
    run.add_argument("--seeds", nargs="+", required=True, help="seeds and ranges, e.g. 0-15")
    run.add_argument("--sft", type=Path, required=True, help="the shared SFT checkpoint (the quickstart's sft folder)")
    run.add_argument("--records", type=Path, default=ROOT / "studies" / "study_records.jsonl")
    run.add_argument("--output", type=Path, default=Path("runs/study"), help="run folders (not kept)")
    run.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 per process side by side)")
    run.add_argument(
        "--block",
        type=int,
        default=None,
        help="run a labelled block of pairs from its own SFT checkpoint (with --sft-seed): every arm "
        "and seed of the block, here, in this one invocation",
    )
    run.add_argument(
        "--sft-seed",
        type=int,
        default=None,
        help="the SFT seed the block's --sft checkpoint was built with (python -m arpo_algo.run.quickstart --sft-seed)",
    )
    run.add_argument("--dry-run", action="store_true", help="check everything and list the runs; write nothing")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each finished run's checkpoints (default: deleted once its record is written)",
    )
    rep = sub.add_parser("report", help="the tables (and figures) from the records")
    rep.add_argument("--records", type=Path, default=ROOT / "studies" / "study_records.jsonl")
    rep.add_argument("--figures", type=Path, default=None, help="write the plots into this folder")
    rep.add_argument("--baseline", default="grpo", help="the arm the others are paired against (default grpo)")
    rep.add_argument(
        "--arms",
        nargs="+",
        default=None,
        help="only these arms in the tables and figures (default: every arm recorded)",
    )
    args = ap.parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    try:
        return {"plan": cmd_plan, "run": cmd_run, "report": cmd_report}[args.command](args)
    except ArpoError as e:
        print(f"error: {e}" + (f"\nhint: {e.hint}" if getattr(e, "hint", None) else ""), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
