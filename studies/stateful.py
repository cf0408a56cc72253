"""Stateful tools over seeds: ARPO with a persistent Python interpreter per trajectory against the stateless tool,
on ToolMath level 5 (a later call needs a list an earlier call built; the stateless tool must rebuild it).

    python -m studies.stateful --seeds 0 1 2 3 4 --output runs/stateful
    python -m studies.stateful --output runs/stateful --report-only

Each arm starts from its own SFT checkpoint, trained once on its own form of the demonstrations (the persistent arm
on calls that name the list again, the stateless arm on calls that rebuild it; same examples, levels and seed
otherwise): a checkpoint taught one form starts the other arm from demonstrations its tool does not fit (the
persistent form fails with NameError in a fresh interpreter; the rebuild form never uses the state). The SFT stage
of an arm is reused by later invocations only when its settings are the same (``<output>/sft_<arm>/study_sft.json``).
Then every (arm, seed) is one ``arpo train`` run with ``model.path`` = the arm's checkpoint, as in
:mod:`studies.compare` (same folders, resume and figures); the two experiment files must have equal budgets.

The report (``report.md``, ``report.json``, plots, from :func:`studies.compare.write_report`) adds, per arm, tool
calls and generated tokens per solved held-out task before and after RL (the held-out run's calls, or its sampled
tokens, divided by the tasks it solved), and the persistent arm's final accuracy minus the stateless arm's, paired by
seed: mean, sd, 95% t-interval, seeds better / worse, and the two-sided exact Wilcoxon signed-rank p
(:func:`studies.compare.paired`; with 5 pairs the smallest p it can give is 0.0625); and each arm's
persistent-interpreter figures during training (forks per step and their cost, the most live, their peak memory).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from arpo_algo.rollout import metrics as MK
from arpo_base.errors import ArpoError, ConfigError
from studies import compare as C

ROOT = Path(__file__).resolve().parent.parent
#: arm -> (experiment file, whether its SFT demonstrations are written for a persistent interpreter)
ARMS: dict[str, tuple[str, bool]] = {
    "persistent": ("experiments/comparisons/compare_stateful_persistent.toml", True),
    "stateless": ("experiments/comparisons/compare_stateful_stateless.toml", False),
}
BASELINE = "stateless"
#: The quickstart's cold start with level 5 in place of level 3: the easy levels teach the tool format, level 5 the
#: two-call form each arm is trained on.
SFT_SETTINGS: dict[str, Any] = {
    "data": "toolmath",
    "num_examples": 192,
    "levels": [1, 2, 5],
    "epochs": 1,
    "lr": 2e-4,
    "batch_size": 8,
    "max_seq_len": 512,
    "log_every": 5,
    "rows_per_forward": 4,
    "gradient_checkpointing": True,
}
SFT_MARKER = "study_sft.json"
#: SFT settings each arm's stage sets itself (see sft_arm).
STUDY_SFT_KEYS = ("persistent_python", "model", "seed", "output_dir", "progress")
EV = MK.EVALUATION


def _parse_sets(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` SFT overrides (VALUE as JSON, else a plain string); keys are checked by SFTConfig, and a key
    the study sets itself per arm is refused (it would be replaced without a word)."""
    out: dict[str, Any] = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--sft-set {item!r} is not KEY=VALUE", hint="e.g. --sft-set num_examples=256")
        if key in STUDY_SFT_KEYS:
            raise ConfigError(
                f"--sft-set {key} is set by the study itself",
                hint={
                    "persistent_python": "each arm's SFT uses its own form of the demonstrations",
                    "model": "use --model",
                    "seed": "use --sft-seed",
                    "output_dir": "use --output",
                    "progress": "use --no-progress",
                }[key],
            )
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def sft_arm(arm: str, out: Path, model: str, seed: int, extra: dict[str, Any], progress: bool) -> str:
    """The arm's SFT checkpoint folder: trained now, or reused when a finished one was made with the same settings.

    Invariant: a checkpoint is reused only for the settings that made it (another model, seed, smoke mode or
    override is refused, never silently mixed into a study)."""
    from arpo_algo.run import smoke
    from arpo_algo.train.sft import SFTConfig, run_sft

    settings = {**SFT_SETTINGS, **extra, "persistent_python": ARMS[arm][1]}
    if smoke.smoke():
        smoke.announce("the study's SFT stages")
        settings["num_examples"] = smoke.capped(settings.get("num_examples"), smoke.SFT_EXAMPLES)
    folder = out / f"sft_{arm}"
    inputs = {"model": model, "seed": seed, "settings": settings, "smoke": smoke.smoke()}
    marker = folder / SFT_MARKER
    if marker.is_file():
        done = json.loads(marker.read_text())
        if done.get("inputs") != inputs:
            raise ConfigError(
                f"{folder} holds the {arm} arm's SFT checkpoint made with {done.get('inputs')}; this "
                f"run asks for {inputs}",
                hint="give this study its own --output folder, or run it with the settings that made the checkpoint",
            )
        print(f"[stateful] {arm}: SFT done earlier with the same settings ({folder})", flush=True)
        return str(folder)
    print(f"[stateful] {arm}: SFT on {'persistent' if ARMS[arm][1] else 'rebuild'}-form demonstrations ...", flush=True)
    cfg = SFTConfig.from_dict(
        {**settings, "model": model, "output_dir": str(folder), "seed": seed, "progress": progress}
    )
    m = run_sft(cfg)
    marker.write_text(
        json.dumps(
            {
                "inputs": inputs,
                "first_loss": m["first_loss"],
                "final_loss": m["final_loss"],
                "steps": m["steps"],
                "time_s": m["time_s"],
            },
            indent=2,
        )
    )
    return str(folder)


def per_solved(run_dir: str) -> dict[str, float | None]:
    """Held-out tool calls and generated tokens per solved task at the first and the last evaluation of a run
    (None where it solved nothing)."""
    from arpo_algo.run.driver import read_metrics

    rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if EV + MK.ACCURACY in r]
    out: dict[str, float | None] = {f"{k}_{w}": None for k in ("calls", "tokens") for w in ("before", "after")}
    if not rows:  # a run that never evaluated (evaluation.every = 0) has no held-out cost to report
        return out
    for when, row in (("before", rows[0]), ("after", rows[-1])):
        n = row.get(EV + MK.TRAJECTORIES, 0.0)
        solved = row[EV + MK.ACCURACY] * n
        out[f"calls_{when}"] = row[EV + MK.TOOL_CALLS_PER_TRAJ] * n / solved if solved else None
        out[f"tokens_{when}"] = row[EV + MK.TOKENS_SAMPLED] / solved if solved else None
    return out


def interpreter_figures(run_dir: str) -> dict[str, float] | None:
    """A run's persistent-interpreter figures over its training steps (None for a run that started none): forks
    per step, mean fork milliseconds, forks failed, and the largest live count and summed PSS (MiB) of any step."""
    from arpo_algo.run.driver import read_metrics

    rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "rollout/interpreters_peak" in r]
    if not rows:
        return None
    forks = sum(r["rollout/interpreter_forks"] for r in rows)
    return {
        "forks_per_step": forks / len(rows),
        "fork_ms": sum(r["rollout/interpreter_fork_ms_total"] for r in rows) / forks if forks else 0.0,
        "forks_failed": sum(r["rollout/interpreter_forks_failed"] for r in rows),
        "interpreters_peak": max(r["rollout/interpreters_peak"] for r in rows),
        # nan where a step could not read its sandboxes' memory (the metric is absent then, never a low guess)
        "pss_mib_peak": max(r.get("rollout/interpreter_pss_mib_peak", math.nan) for r in rows)
        if all("rollout/interpreter_pss_mib_peak" in r for r in rows)
        else math.nan,
    }


def _mean(xs: list[float | None]) -> str:
    kept = [x for x in xs if x is not None]
    return f"{sum(kept) / len(kept):.1f} ({len(kept)}/{len(xs)} seeds)" if kept else "none solved"


def stateful_section(runs: dict[str, dict[int, dict[str, Any]]], rep: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The study's own table (cost per solved task) and paired test, as markdown and as JSON."""
    cost = {arm: {s: per_solved(r["output"]) for s, r in seeds.items()} for arm, seeds in runs.items()}
    lines = [
        "",
        "Held-out cost per solved task, mean over seeds (seeds that solved any):",
        "",
        "| arm | tool calls before | tool calls after | generated tokens before | generated tokens after |",
        "|---|---|---|---|---|",
    ]
    for arm, seeds in cost.items():
        col = {
            k: [c[k] for c in seeds.values()] for k in ("calls_before", "calls_after", "tokens_before", "tokens_after")
        }
        lines.append(f"| {arm} | " + " | ".join(_mean(v) for v in col.values()) + " |")
    figs = {arm: {s: interpreter_figures(r["output"]) for s, r in seeds.items()} for arm, seeds in runs.items()}
    lines += [
        "",
        "Persistent interpreters during training (steps that started any), mean over seeds:",
        "",
        "| arm | forks per step | fork ms | forks failed | most live at once | peak summed PSS (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for arm, seeds in figs.items():
        kept = [f for f in seeds.values() if f is not None]
        cells = [
            f"{sum(f[k] for f in kept) / len(kept):.1f}" if kept else "none"
            for k in ("forks_per_step", "fork_ms", "forks_failed", "interpreters_peak", "pss_mib_peak")
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    pairs = C.paired(rep, BASELINE) if BASELINE in rep else {}
    test: dict[str, Any] = {}
    for arm, p in pairs.items():
        p_value, n_used = p["wilcoxon_p"], sum(abs(d) > 1e-12 for d in p["per_seed"].values())
        test[arm] = {"wilcoxon_p": p_value, "nonzero_pairs": n_used}
        lines += [
            "",
            f"{arm} minus {BASELINE}, final held-out accuracy paired by seed: "
            f"{p['diff']['mean']:+.3f} ± {p['diff']['sd']:.3f} (95% t-interval ± {p['diff']['ci95']:.3f}), "
            f"better / worse {p['better']} / {p['worse']} of {len(p['seeds'])}, two-sided Wilcoxon "
            f"signed-rank p = {p_value:.3f} ({n_used} non-zero pairs).",
        ]
    return "\n".join(lines) + "\n", {"cost_per_solved": cost, "interpreters": figs, "paired": pairs, "test": test}


def train(args: argparse.Namespace) -> dict[str, dict[int, dict[str, Any]]]:
    from arpo_algo.run.experiment import load_experiment

    extra = _parse_sets(args.sft_set)
    sft = {arm: sft_arm(arm, args.output, args.model, args.sft_seed, extra, not args.no_progress) for arm in ARMS}
    common = {arm: [f"model.path={json.dumps(path)}", *args.set] for arm, path in sft.items()}
    exps = {arm: load_experiment(str(ROOT / ARMS[arm][0]), common[arm]) for arm in ARMS}
    C.check_equal_budget(exps)
    runs: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in ARMS}
    for seed in args.seeds:  # seed-major: an interrupted study still has both arms of every finished seed
        for arm in ARMS:
            out = args.output / arm / f"seed_{seed}"
            done = C.finished_run(out)
            if done is None:
                done = C.run_one(
                    str(ROOT / ARMS[arm][0]), [*common[arm], f"experiment.seed={seed}"], out, not args.no_progress
                )
            runs[arm][seed] = done
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--output", type=Path, default=Path("runs/stateful"))
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the base model both arms' SFT starts from")
    ap.add_argument("--sft-seed", type=int, default=0, help="the seed of both SFT stages")
    ap.add_argument(
        "--sft-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an SFT setting of both arms (arpo sft's keys), e.g. num_examples=256",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="an RL override of every run"
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads of this process")
    ap.add_argument("--report-only", action="store_true", help="train nothing: report the finished runs under --output")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        if args.report_only:
            runs = {arm: r for arm, r in C.finished_runs(args.output, args.seeds).items() if arm in ARMS}
        else:
            runs = train(args)
    except ArpoError as e:
        print(f"error: {e}" + (f"\nhint: {e.hint}" if getattr(e, "hint", None) else ""), file=sys.stderr)
        return 2
    rep = C.summarize(runs)
    report = C.write_report(rep, runs, args.output)
    text, extra = stateful_section(runs, rep)
    with report.open("a") as f:
        f.write(text)
    (args.output / "stateful.json").write_text(json.dumps(extra, indent=2, default=str))
    print(report.read_text())
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
