"""The quickstart's stage times per rollout decode path and learner precision, side by side in one run.

Each variant, a decode mode (``rollouts.hf.decode``: dynamic, static, compiled) at a learner precision (the
quickstart's ``--precision``), runs the quickstart's ARPO and evaluation stages from one SFT checkpoint, in a fresh
process of its own (no compile cache, allocator state or page cache carried from one variant to the next beyond what
the disk keeps), with the same seeds; rounds repeat the variants in alternating order so a change of the machine's load
falls on both sides. Printed per variant: the ARPO stage's wall time, the time its rollouts spent generating and the
tokens they sampled (so a variant that happens to sample longer answers is visible), the update time, the evaluation
stage's time, the held-out accuracies, each stage's peak resident memory, and each time's ratio to the first variant;
then, per variant, where the time goes: every stage's wall time, its CPU time (this process and its finished
children, as the quickstart records it), the cores it kept busy (CPU / wall) and its share of the run's wall
time. The pull and SFT stages are not re-run: their figures are those of the run that made the ``--sft`` folder.

    python -m benchmarks.bench_quickstart --sft runs/quickstart --modes dynamic static --rounds 1 --threads 2
    python -m benchmarks.bench_quickstart --sft runs/quickstart --modes dynamic --learner-precisions fp32 native

``--sft`` is a quickstart output folder whose SFT stage is done (its ``.stage_pull.json`` and ``.stage_sft.json``
markers are copied, so the SFT stage is not re-run and every variant starts from the same weights; each run passes the
SFT stage's own ``--sft-precision`` on). A variant is named by its decode mode, followed by its learner precision
when several are compared. ``--set`` passes further overrides to every variant (e.g. ``experiment.iterations=2`` for
a shorter run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from arpo_algo.run.quickstart import LEARNER_PRECISION, PRECISION_CHOICES, with_old_precisions

MODES = ("dynamic", "static", "compiled")
STAGE_MARKERS = (".stage_pull.json", ".stage_sft.json")


def run_mode(
    args: argparse.Namespace, mode: str, out: Path, precision: str, label: str | None = None
) -> dict[str, Any]:
    """One quickstart run (ARPO, evaluation, export) with ``rollouts.hf.decode = mode`` and the learner at
    ``precision``, in its own process; its figures are filed under ``label`` (default: the mode)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in STAGE_MARKERS:
        shutil.copy(Path(args.sft) / name, out / name)
    # the SFT folder's precision setting, or its marker would not match and the SFT stage would run again
    sft_inputs = json.loads((Path(args.sft) / ".stage_sft.json").read_text())["inputs"]
    sft_precision = with_old_precisions(sft_inputs, {"precision": None})["precision"]  # as the quickstart reads it
    cmd = [
        sys.executable,
        "-m",
        "arpo_algo.run.quickstart",
        "--output",
        str(out),
        "--seed",
        str(args.seed),
        "--sft-precision",
        sft_precision,
        "--precision",
        precision,
        "--set",
        f"rollouts.hf.decode={json.dumps(mode)}",
        "--no-progress",
    ]
    if mode == "compiled":  # fenced as experimental in the settings
        cmd += ["--set", "rollouts.hf.experimental_compiled_decode=true"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    for extra in args.set:
        cmd += ["--set", extra]
    log = out / "quickstart.log"
    with log.open("w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(
            f"error: the quickstart with decode={mode!r}, learner {precision} exited with {rc}; "
            f"the end of {log}:\n{tail}"
        )
    return {**read_run(out, label or mode), "decode": mode, "learner_precision": precision}


def read_run(out: Path, mode: str) -> dict[str, Any]:
    """The figures of one finished quickstart run folder."""
    from arpo_algo.run.driver import read_metrics

    summary = json.loads((out / "summary.json").read_text())
    evaluation = json.loads((out / ".stage_evaluate.json").read_text())
    metrics = read_metrics(out / "arpo" / "metrics.jsonl")
    return {
        "mode": mode,
        "arpo_s": summary["stage_times_s"]["arpo"],
        "evaluate_s": summary["stage_times_s"]["evaluate"],
        "generate_s": sum(m.get("rollout/time_generate_s", 0.0) for m in metrics),
        "update_s": sum(m.get("timers/update_time", 0.0) for m in metrics),
        "tokens_sampled": sum(m.get("train/tokens_sampled", 0.0) for m in metrics),
        "eval_tokens": sum(evaluation[k].get("tokens_sampled", 0.0) for k in ("before", "after")),
        "eval_decode": [evaluation[k]["decode"] for k in ("before", "after")],
        "before": summary["accuracy_after_sft"],
        "after": summary["accuracy_after_arpo"],
        "peak_rss_gb": summary["peak_rss_gb"],
        "stages": {
            name: {"wall_s": wall, "cpu_s": summary.get("stage_cpu_s", {}).get(name)}
            for name, wall in summary["stage_times_s"].items()
        },
    }


def stage_table(runs: list[dict[str, Any]], modes: list[str]) -> list[str]:
    """Per variant and stage: the median over rounds of the wall and CPU time, the cores busy (CPU / wall) and the
    stage's share of the summed wall time. A CPU time the run did not record (a stage done by an older version)
    shows as "-"."""
    lines = [
        "| variant | stage | wall s | CPU s | cores busy | share of wall |",
        "|---|---|---|---|---|---|",
    ]
    for m in modes:
        mine = [r["stages"] for r in runs if r["mode"] == m]
        names = list(mine[0])
        wall = {n: statistics.median([st[n]["wall_s"] for st in mine]) for n in names}
        cpu_seen = {n: [st[n]["cpu_s"] for st in mine if st[n]["cpu_s"] is not None] for n in names}
        total = sum(wall.values())
        for n in names:
            cpu = statistics.median(cpu_seen[n]) if cpu_seen[n] else None
            cpu_text = "-" if cpu is None else f"{cpu:.1f}"
            busy = "-" if cpu is None or not wall[n] else f"{cpu / wall[n]:.2f}"
            share = f"{wall[n] / total:.0%}" if total else "-"
            lines.append(f"| {m} | {n} | {wall[n]:.1f} | {cpu_text} | {busy} | {share} |")
    return lines


def table(runs: list[dict[str, Any]], modes: list[str]) -> list[str]:
    """Per variant: the median over rounds of each figure, and its ratio to the first variant's (time ratios as base /
    this, so above 1 is faster)."""
    cols = ("arpo_s", "generate_s", "update_s", "tokens_sampled", "evaluate_s", "eval_tokens")
    med = {m: {c: statistics.median([r[c] for r in runs if r["mode"] == m]) for c in cols} for m in modes}
    base = med[modes[0]]
    lines = [
        "| variant | ARPO stage s | rollouts generating s | update s | tokens sampled | generate tok/s "
        "| evaluation s | eval tokens | ARPO stage speed-up | generate tok/s ratio | evaluation speed-up "
        "| accuracy before -> after | peak GB (ARPO, evaluation) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in modes:
        f = med[m]
        rate = f["tokens_sampled"] / f["generate_s"] if f["generate_s"] else 0.0
        base_rate = base["tokens_sampled"] / base["generate_s"] if base["generate_s"] else 0.0
        acc = ", ".join(f"{r['before']:.3f} -> {r['after']:.3f}" for r in runs if r["mode"] == m)
        peak = ", ".join(
            f"{r['peak_rss_gb'].get('arpo') or 0:.2f} / {r['peak_rss_gb'].get('evaluate') or 0:.2f}"
            for r in runs
            if r["mode"] == m
        )
        lines.append(
            f"| {m} | {f['arpo_s']:.0f} | {f['generate_s']:.0f} | {f['update_s']:.0f} | "
            f"{f['tokens_sampled']:.0f} | {rate:.1f} | {f['evaluate_s']:.0f} | {f['eval_tokens']:.0f} | "
            f"{base['arpo_s'] / f['arpo_s']:.2f}x | {rate / base_rate if base_rate else 0.0:.2f}x | "
            f"{base['evaluate_s'] / f['evaluate_s']:.2f}x | {acc} | {peak} |"
        )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_quickstart", description=__doc__.splitlines()[0])
    parser.add_argument("--sft", required=True, help="a quickstart output folder whose SFT stage is done")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["dynamic", "static"],
        choices=MODES,
        help="decode modes; ratios are to the first (default: dynamic static)",
    )
    parser.add_argument(
        "--learner-precisions",
        nargs="+",
        default=[LEARNER_PRECISION],
        choices=PRECISION_CHOICES,
        help=f"the RL learner's precisions (the quickstart's --precision; default {LEARNER_PRECISION}); with "
        "several, each decode mode runs at each, and ratios are to the first variant",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="VARIANT",
        help="run only these variants of the grid (e.g. 'dynamic fp32' 'static native')",
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds over the variants, alternating their order")
    parser.add_argument("--seed", type=int, default=0, help="the RL stage's seed (default 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per run")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="an override of arpo_algo/run/recipes/quickstart.toml for every mode",
    )
    parser.add_argument("--output", default="runs/bench_quickstart", help="folder of the runs (replaced per run)")
    parser.add_argument("--json", help="write the runs and the table here")
    args = parser.parse_args(argv)
    missing = [n for n in STAGE_MARKERS if not (Path(args.sft) / n).is_file()]
    if missing:
        raise SystemExit(
            f"error: {args.sft} has no {', '.join(missing)}: pass a quickstart output folder whose SFT "
            "stage is done (python -m arpo_algo.run.quickstart writes one)"
        )
    if len(set(args.modes)) != len(args.modes) or args.rounds < 1:
        raise SystemExit("error: --modes must not repeat a mode and --rounds must be >= 1")
    precisions = args.learner_precisions
    if len(set(precisions)) != len(precisions):
        raise SystemExit("error: --learner-precisions must not repeat a precision")
    variants = [(m if len(precisions) == 1 else f"{m} {p}", m, p) for m in args.modes for p in precisions]
    if args.only:
        unknown = [o for o in args.only if o not in {v[0] for v in variants}]
        if unknown:
            raise SystemExit(
                f"error: --only {', '.join(map(repr, unknown))}: not a variant of this grid; its variants are "
                + ", ".join(repr(v[0]) for v in variants)
            )
        variants = [v for v in variants if v[0] in args.only]
    labels = [v[0] for v in variants]

    from studies.study import machine

    info = machine()
    print(f"[bench_quickstart] {info['cpu']}, torch {info['torch']}, transformers {info['transformers']}", flush=True)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else list(reversed(variants))
        for label, mode, precision in order:
            load = os.getloadavg()[0]  # the machine's own load: a busy machine stretches every wall time
            print(
                f"[bench_quickstart] round {r + 1}: decode={mode}, learner {precision} (load average {load:.2f})",
                flush=True,
            )
            res = run_mode(args, mode, Path(args.output) / f"{label.replace(' ', '_')}_r{r + 1}", precision, label)
            runs.append({"round": r + 1, "load_before": load, **res})
            print(
                f"[bench_quickstart]   ARPO {res['arpo_s']:.0f} s (generating {res['generate_s']:.0f} s, "
                f"{res['tokens_sampled']:.0f} tokens), evaluation {res['evaluate_s']:.0f} s, "
                f"accuracy {res['before']:.3f} -> {res['after']:.3f}",
                flush=True,
            )
    lines = table(runs, labels)
    print("\n".join(lines))
    stages = stage_table(runs, labels)
    print("\n".join(stages))
    result = {
        "machine": info,
        "modes": args.modes,
        "learner_precisions": precisions,
        "variants": labels,
        "rounds": args.rounds,
        "runs": runs,
        "table": lines,
        "stage_table": stages,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
