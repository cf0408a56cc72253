"""Compare experiment files over several seeds from ONE shared SFT checkpoint, so the seeds differ only by the RL run.

    python -m studies.compare experiments/comparisons/compare_arpo.toml experiments/comparisons/compare_grpo.toml \
        --sft runs/quickstart/sft --seeds 0 1 2 --output runs/compare [--equal-budget] [--set section.key=value]

Every (configuration, seed) is one ``arpo train`` run (in this process, one after the other) with
``model.path = --sft`` and ``experiment.seed = seed``, into ``<output>/<config>/seed_<s>/`` where ``rerun.json``
holds the exact ``arpo train`` command that reproduces it. Then, per configuration: held-out accuracy before and
after (mean, sd, 95% t-interval over seeds), the seeds that improved, tool calls and generated tokens per
iteration and in total, wall time; ``report.md``, ``report.json`` and two plots (accuracy against iteration and
against cumulative tool calls, mean over seeds with a min-max band). Accuracy points between the first and the last
come from ``evaluation.every`` (``--eval-every``).

Variants of one file (a stabilizer study): ``--name arpo+dynsamp --set training.dynamic_sampling=true`` names the
configuration's folder. ``--report-only`` reports every configuration with finished runs under ``--output`` (however
many processes trained them), and ``--baseline NAME`` adds each configuration's final accuracy minus that one's,
paired by seed (mean, sd, 95% t-interval, seeds better / worse).

``--equal-budget`` refuses configurations that differ in the budget (trajectories per prompt, prompts per step,
iterations, response tokens, tool calls per trajectory) or in the optimizer steps each batch may take
(``training.mini_batches``, as resolved for the run, and ``training.ppo_epochs``), naming the field. A group without
reward spread takes no step, so the steps a run realises can still differ between arms: the report gives them per
configuration. Same seed, same machine: same result on
CPU (the sampler, the learner and the tools are seeded; tested on a tiny model).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from arpo_algo.rollout import diagnostics as D
from arpo_algo.rollout import learner_metrics as LK
from arpo_algo.rollout import metrics as MK
from arpo_base.errors import ConfigError

#: (name, how to read it from a loaded experiment) of every setting that sets the compute budget of a run.
BUDGET_FIELDS: tuple[tuple[str, Any], ...] = (
    ("tree.budget", lambda e: e.config.settings.tree.budget),
    ("training.prompts_per_step", lambda e: e.config.settings.training.prompts_per_step),
    ("experiment.iterations", lambda e: e.run.iterations),
    ("rollouts.max_response_tokens", lambda e: e.config.settings.rollouts.max_response_tokens),
    ("env.max_tool_calls", lambda e: (e.config.env_config or {}).get("max_tool_calls")),
    # the optimizer steps a batch may take: an arm with more steps per batch is not the same budget of learning
    # (AEPO's unset mini_batches resolves to min(8, prompts_per_step), so the resolved count is compared)
    ("training.mini_batches", lambda e: e.config.settings.training.mini_batch_count),
    ("training.ppo_epochs", lambda e: e.config.settings.training.ppo_epochs),
)
_SAFE_NAME = re.compile(r"[A-Za-z0-9._+-]+")
#: written into a run folder when the run completed; a rerun of the comparison skips such runs (resume).
RUN_RESULT = "compare_run.json"
#: Per-iteration metrics averaged over a run's iterations (then over seeds) for the report's diagnostics table:
#: what differs between configurations besides the outcome.
DIAGNOSTICS = {
    "groups without reward variance": D.ZERO_VARIANCE_GROUP_FRAC,
    "branches per group": D.BRANCHES_PER_GROUP,
    "fill-ups per group": D.FILLUPS_PER_GROUP,
    "distinct trajectories per group": D.DISTINCT_TRAJECTORIES,
    "trajectories with gradient": D.TRAJ_WITH_GRAD,
    "training reward": MK.TRAIN + MK.REWARD_MEAN,
    "iteration time (s)": MK.TIMERS + "training_iteration",
    "rollout tokens/s": MK.TRAIN + MK.TOKENS_PER_S,
    "learner update (s)": MK.TIMERS + "update_time",
}
EVAL_ACCURACY = MK.EVALUATION + MK.ACCURACY
#: The optimizer steps one update took (0 for an update without signal), as logged per iteration.
OPTIMIZER_STEPS = LK.PREFIX + LK.OPTIMIZER_STEPS
# two-sided 95% Student t quantiles by degrees of freedom (1..30); larger: 1.96
T95 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


def stats(xs: list[float]) -> dict[str, float]:
    """Mean, sample sd and the 95% confidence half-width of the mean (t distribution); n = 1 gives sd 0, CI nan."""
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": math.nan, "sd": math.nan, "ci95": math.nan}
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    ci = (T95[n - 2] if n - 1 <= len(T95) else 1.96) * sd / math.sqrt(n) if n > 1 else math.nan
    return {"n": n, "mean": m, "sd": sd, "ci95": ci}


def check_equal_budget(exps: dict[str, Any]) -> None:
    """Raise ConfigError naming the first budget field whose value differs between configurations."""
    for field, get in BUDGET_FIELDS:
        values = {name: get(e) for name, e in exps.items()}
        if len(set(map(repr, values.values()))) > 1:
            shown = ", ".join(f"{n}: {v}" for n, v in values.items())
            raise ConfigError(
                f"--equal-budget: the configurations differ in {field} ({shown})",
                hint=f"set the same {field} in every file, or drop --equal-budget",
            )


def run_one(file: str, overrides: list[str], out: Path, progress: bool) -> dict[str, Any]:
    """One training run; writes ``rerun.json`` first (the command that reproduces it)."""
    from arpo_algo.run.driver import train_experiment
    from arpo_algo.run.experiment import load_experiment

    exp = load_experiment(file, overrides)
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["arpo", "train", str(file), *sum((["--set", o] for o in overrides), []), "--output", str(out)]
    (out / "rerun.json").write_text(
        json.dumps(
            {"command": shlex.join(cmd), "file": str(file), "overrides": overrides, "sections": exp.sections},
            indent=2,
            default=repr,
        )
    )
    t0 = time.time()
    summary = train_experiment(exp, output=out, progress=progress)
    result = collect(out, summary["accuracy_before"], summary["accuracy_after"], time.time() - t0)
    (out / RUN_RESULT).write_text(json.dumps(result, indent=2))
    return result


def collect(out: Path, before: float, after: float, time_s: float) -> dict[str, Any]:
    """A finished run's figures, read from its ``metrics.jsonl`` (so a report can always be rebuilt from disk)."""
    from arpo_algo.run.driver import read_metrics

    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if r["iteration"] > 0 and MK.TOOL_CALLS in r]
    calls = [r[MK.TOOL_CALLS] for r in train]
    tokens = [r.get(MK.TOKENS_GENERATED, 0.0) for r in train]
    cum, curve = 0.0, []
    by_iter = {r["iteration"]: r for r in train}
    for r in rows:
        cum += by_iter.get(r["iteration"], {}).get(MK.TOOL_CALLS, 0.0) if r["iteration"] > 0 else 0.0
        if EVAL_ACCURACY in r:
            curve.append((r["iteration"], cum, r[EVAL_ACCURACY]))
    diag = {}
    for label, key in DIAGNOSTICS.items():
        xs = [r[key] for r in train if key in r]
        diag[label] = sum(xs) / len(xs) if xs else 0.0  # absent = never happened (e.g. no branch metric in GRPO)
    return {
        "before": before,
        "after": after,
        "time_s": time_s,
        "tool_calls": calls,
        "tokens": tokens,
        "curve": curve,
        "output": str(out),
        "diag": diag,
        "zero_variance": [r.get(D.ZERO_VARIANCE_GROUP_FRAC) for r in train],
        "skipped": sum(r.get(D.SKIPPED_NO_SIGNAL, 0.0) for r in train),
        # None: the run's metrics do not carry the count (a run logged before it existed), not zero steps
        "optimizer_steps": (
            sum(r[OPTIMIZER_STEPS] for r in train if OPTIMIZER_STEPS in r)
            if any(OPTIMIZER_STEPS in r for r in train)
            else None
        ),
    }


def finished_run(out: Path) -> dict[str, Any] | None:
    """The result of a run that completed earlier (``compare_run.json`` marks it), re-read from its metrics; else
    None."""
    path = out / RUN_RESULT
    if not path.is_file():
        return None
    done = json.loads(path.read_text())
    return collect(out, done["before"], done["after"], done["time_s"])


def summarize(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    rep: dict[str, Any] = {}
    for name, seeds in runs.items():
        if not seeds:  # not run yet (the partial report after the first runs of a comparison)
            continue
        rs = list(seeds.values())
        before, after = [r["before"] for r in rs], [r["after"] for r in rs]
        calls = [c for r in rs for c in r["tool_calls"]]
        toks = [t for r in rs for t in r["tokens"]]
        best = [max([a for _, _, a in r["curve"]] + [r["after"]]) for r in rs]
        rep[name] = {
            "seeds": sorted(seeds),
            "before": stats(before),
            "after": stats(after),
            "delta": stats([a - b for a, b in zip(after, before)]),
            "improved": sum(a > b for a, b in zip(after, before)),
            "worse": sum(a < b for a, b in zip(after, before)),
            "best": stats(best),
            "drop_from_best": stats([b - a for b, a in zip(best, after)]),
            "tool_calls_per_step": sum(calls) / max(len(calls), 1),
            "tool_calls_total": sum(calls) / max(len(rs), 1),
            "tokens_per_step": sum(toks) / max(len(toks), 1),
            "tokens_total": sum(toks) / max(len(rs), 1),
            "time_s": stats([r["time_s"] for r in rs])["mean"],
            "skipped_updates": sum(r["skipped"] for r in rs) / max(len(rs), 1),
            "optimizer_steps": _steps([r.get("optimizer_steps") for r in rs]),
            "diag": {k: sum(r["diag"][k] for r in rs) / len(rs) for k in DIAGNOSTICS},
            "per_seed": {
                s: {"before": r["before"], "after": r["after"], "output": r["output"]} for s, r in seeds.items()
            },
        }
    return rep


def _steps(per_run: list[float | None]) -> dict[str, float] | None:
    """Optimizer steps per run over seeds (mean, min, max); None when any run does not carry the count."""
    if not per_run or any(x is None for x in per_run):
        return None
    xs = [float(x) for x in per_run if x is not None]
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)}


def _steps_cell(s: dict[str, float] | None) -> str:
    return "not logged" if s is None else f"{s['mean']:.1f} ({s['min']:.0f} - {s['max']:.0f})"


def write_report(
    rep: dict[str, Any], runs: dict[str, dict[int, dict[str, Any]]], out: Path, pairs: dict[str, Any] | None = None
) -> Path:
    def f(s: dict[str, float]) -> str:
        return f"{s['mean']:.3f} ± {s['sd']:.3f} (95% t-interval ± {s['ci95']:.3f})"

    lines = [
        "| configuration | seeds | before | after | after - before | improved / worse | best during the run | "
        "best - after | tool calls per step (total) | tokens per step (total) | skipped updates | optimizer steps "
        "per run (min - max) | wall time per run |",
        "|" + "---|" * 13,
    ]
    for name, r in rep.items():
        lines.append(
            f"| {name} | {len(r['seeds'])} | {f(r['before'])} | {f(r['after'])} | {f(r['delta'])} | "
            f"{r['improved']} / {r['worse']} | {r['best']['mean']:.3f} ± {r['best']['sd']:.3f} | "
            f"{r['drop_from_best']['mean']:.3f} ± {r['drop_from_best']['sd']:.3f} | "
            f"{r['tool_calls_per_step']:.1f} ({r['tool_calls_total']:.0f}) "
            f"| {r['tokens_per_step']:.0f} ({r['tokens_total']:.0f}) | {r['skipped_updates']:.1f} | "
            f"{_steps_cell(r['optimizer_steps'])} | {r['time_s']:.0f} s |"
        )
    lines += [
        "",
        "Diagnostics, mean over iterations and seeds:",
        "",
        "| configuration | " + " | ".join(DIAGNOSTICS) + " |",
        "|" + "---|" * (len(DIAGNOSTICS) + 1),
    ]
    for name, r in rep.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['diag'][k]:.2f}" for k in DIAGNOSTICS) + " |")
    if pairs:
        lines += [
            "",
            "Final accuracy minus the baseline's, paired by seed:",
            "",
            "| configuration | seeds | difference (mean ± sd, 95% t-interval) | better / worse | exact Wilcoxon p "
            "| per seed |",
            "|---|---|---|---|---|---|",
        ]
        for name, p in pairs.items():
            per = ", ".join(f"{s}: {d:+.3f}" for s, d in p["per_seed"].items())
            lines.append(
                f"| {name} | {len(p['seeds'])} | {f(p['diff'])} | {p['better']} / {p['worse']} "
                f"| {p['wilcoxon_p']:.3f} | {per} |"
            )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "report.json").write_text(json.dumps({"summary": rep, "paired": pairs, "runs": runs}, indent=2, default=str))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return out / "report.md"
    for xi, label, fname in (
        (0, "iteration", "accuracy_vs_iteration.png"),
        (1, "cumulative tool calls", "accuracy_vs_tool_calls.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, seeds in runs.items():
            curves = [r["curve"] for r in seeds.values() if r["curve"]]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            xs = [sum(c[i][xi] for c in curves) / len(curves) for i in range(n)]
            ys = [[c[i][2] for c in curves] for i in range(n)]
            ax.plot(xs, [sum(y) / len(y) for y in ys], marker="o", label=f"{name} (n={len(curves)})")
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.2)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)
    return out / "report.md"


def run_precision(output: Path, runs: dict[str, dict[int, Any]]) -> str:
    """The learner precision the runs resolved (their config.json's compute record): one value, "mixed", or
    "unrecorded" for runs made before run folders recorded it."""
    found = set()
    for name, seeds in runs.items():
        for seed in seeds:
            record = json.loads((output / name / f"seed_{seed}" / "config.json").read_text())
            found.add(record.get("compute", {}).get("precision", "unrecorded"))
    return found.pop() if len(found) == 1 else "mixed"


def write_reference(rep: dict[str, Any], path: Path, argv: list[str], precision: str) -> None:
    """The quickstart's multi-seed reference: per configuration before, after (mean, sd), seeds improved / worse, and
    the learner precision of the runs (the quickstart prints it beside its own run's)."""
    import platform

    from arpo_algo.rollout.engines.vllm.support import cpu_features

    flags = sorted(f for f, present in cpu_features().items() if present)
    seeds = {len(r["seeds"]) for r in rep.values()}
    ref = {
        "num_seeds": max(seeds),
        "sft_seed": 0,
        "precision": precision,
        "command": "python -m studies.compare " + shlex.join(argv),
        "machine": f"{platform.machine()} CPU ({', '.join(flags) or 'flags unknown'}), {time.strftime('%Y-%m-%d')}",
        "configurations": {
            name.removeprefix("compare_"): {
                "seeds": len(r["seeds"]),
                "before": r["before"]["mean"],
                "after_mean": r["after"]["mean"],
                "after_sd": r["after"]["sd"],
                "improved": r["improved"],
                "worse": r["worse"],
            }
            for name, r in rep.items()
        },
    }
    path.write_text(json.dumps(ref, indent=2) + "\n")


def train_all(args: argparse.Namespace) -> dict[str, dict[int, dict[str, Any]]]:
    """Train every (configuration, seed) not finished yet under ``args.output`` (seed-major) and return the runs."""
    from arpo_algo.run.experiment import load_experiment

    if not args.experiments or args.sft is None:
        raise ConfigError("training needs experiment files and --sft (or --report-only to report finished runs)")
    if args.name is not None and (len(args.experiments) != 1 or not _SAFE_NAME.fullmatch(args.name)):
        raise ConfigError(
            f"--name {args.name!r} needs exactly one experiment file and a folder name made of "
            f"letters, digits and . _ + - (got {len(args.experiments)} files)"
        )
    common = [f"model.path={json.dumps(str(args.sft))}", *args.set]
    if args.eval_every is not None:
        common.append(f"evaluation.every={args.eval_every}")
    names: dict[str, str] = {}
    for file in args.experiments:
        name = args.name or Path(file).stem
        names[name if name not in names else f"{name}_{len(names)}"] = file
    exps = {n: load_experiment(f, common) for n, f in names.items()}
    if args.equal_budget:
        check_equal_budget(exps)
    seeds = args.seeds if args.seeds is not None else [0, 1, 2]
    runs: dict[str, dict[int, dict[str, Any]]] = {n: {} for n in names}
    for seed in seeds:  # seed-major: an interrupted comparison still has every configuration
        for name, file in names.items():
            out = args.output / name / f"seed_{seed}"
            done = finished_run(out)
            if done is None:
                done = run_one(file, [*common, f"experiment.seed={seed}"], out, not args.no_progress)
            runs[name][seed] = done
            (args.output / f"partial_{'_'.join(names)}_{'_'.join(map(str, seeds))}.json").write_text(
                json.dumps(summarize(runs), indent=2, default=str)
            )
    return runs


def finished_runs(output: Path, seeds: list[int] | None) -> dict[str, dict[int, dict[str, Any]]]:
    """Every configuration folder under ``output`` with finished runs (of ``seeds``, or all), sorted by name."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for marker in sorted(output.glob(f"*/seed_*/{RUN_RESULT}")):
        seed = int(marker.parent.name.removeprefix("seed_"))
        if seeds is None or seed in seeds:
            runs.setdefault(marker.parent.parent.name, {})[seed] = finished_run(marker.parent)
    if not runs:
        raise ConfigError(f"no finished runs under {output} (a run is finished when {RUN_RESULT} is there)")
    for name, done in runs.items():
        for seed in sorted(set(seeds or ()) - set(done)):
            print(f"[compare] {name} seed {seed}: not finished, left out of the report", file=sys.stderr)
    return {n: dict(sorted(r.items())) for n, r in runs.items()}


def wilcoxon(diffs: list[float]) -> tuple[float, int]:
    """Two-sided exact Wilcoxon signed-rank p-value of ``diffs`` (zeros dropped, average ranks for ties); the
    number of non-zero differences. The null distribution of the positive rank sum is counted exactly over all 2^n
    sign patterns of the observed (doubled, so integer) ranks."""
    d = [x for x in diffs if abs(x) > 1e-12]
    n = len(d)
    if n == 0:
        return 1.0, 0
    order = sorted(range(n), key=lambda i: abs(d[i]))
    ranks = [0] * n  # doubled average ranks
    i = 0
    while i < n:
        j = i
        while j + 1 < n and abs(abs(d[order[j + 1]]) - abs(d[order[i]])) < 1e-12:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = i + j + 2  # 2 * mean of ranks i+1 .. j+1
        i = j + 1
    total = sum(ranks)
    counts = [0] * (total + 1)
    counts[0] = 1
    for r in ranks:
        for s in range(total, r - 1, -1):
            counts[s] += counts[s - r]
    w_plus = sum(r for r, x in zip(ranks, d) if x > 0)
    extreme = min(w_plus, total - w_plus)
    tail = sum(counts[: extreme + 1])
    return min(1.0, 2 * tail / 2**n), n


def paired(rep: dict[str, Any], baseline: str) -> dict[str, Any]:
    """Per configuration: final accuracy minus the baseline's on the seeds both ran (mean, sd, 95% t-interval,
    better/worse, the exact two-sided Wilcoxon signed-rank p-value)."""
    base = rep[baseline]["per_seed"]
    out = {}
    for name, r in rep.items():
        common = [s for s in r["per_seed"] if s in base and name != baseline]
        if common:
            d = [r["per_seed"][s]["after"] - base[s]["after"] for s in common]
            out[name] = {
                "seeds": common,
                "diff": stats(d),
                "better": sum(x > 0 for x in d),
                "worse": sum(x < 0 for x in d),
                "wilcoxon_p": wilcoxon(d)[0],
                "per_seed": dict(zip(common, d)),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    from arpo_base.errors import ArpoError

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("experiments", nargs="*", help="experiment files (or names in experiments/)")
    ap.add_argument("--sft", default=None, help="the shared starting checkpoint (model.path of every run)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (report: every finished seed)")
    ap.add_argument("--output", type=Path, default=Path("runs/compare"))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override, all runs")
    ap.add_argument(
        "--name",
        default=None,
        help="with one experiment file: the configuration's name (its folder "
        "under --output) instead of the file's, e.g. for a variant made with --set",
    )
    ap.add_argument(
        "--baseline",
        default=None,
        metavar="NAME",
        help="also report every other configuration's per-seed difference in final accuracy to this one",
    )
    ap.add_argument("--eval-every", type=int, default=None, help="evaluation.every of every run")
    ap.add_argument("--equal-budget", action="store_true", help="refuse configurations that differ in budget")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads of this process (1 per process when several run side by side)",
    )
    ap.add_argument(
        "--reference",
        type=Path,
        default=None,
        metavar="JSON",
        help="also write the per-configuration distribution over seeds that the quickstart prints beside "
        "its own result (arpo_algo/run/recipes/quickstart_reference.json)",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: report every configuration with finished runs under --output (several "
        "comparison processes may share one --output, each with its own --seeds or --name)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        runs = finished_runs(args.output, args.seeds) if args.report_only else train_all(args)
        if args.baseline is not None and args.baseline not in runs:
            raise ConfigError(
                f"--baseline {args.baseline!r} is not a configuration with finished runs under "
                f"{args.output} (there: {', '.join(runs) or 'none'})"
            )
    except ArpoError as e:
        print(f"error: {e}" + (f"\nhint: {e.hint}" if getattr(e, "hint", None) else ""), file=sys.stderr)
        return 2
    rep = summarize(runs)
    report = write_report(rep, runs, args.output, paired(rep, args.baseline) if args.baseline else None)
    if args.reference:
        precision = run_precision(args.output, runs)
        write_reference(rep, args.reference, argv if argv is not None else sys.argv[1:], precision)
    print(report.read_text())
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
