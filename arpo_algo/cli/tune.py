"""``arpo tune``: Ray Tune sweeps over ARPO's knobs (see :mod:`arpo_algo.run.sweep` for the sweep file)."""

from __future__ import annotations

import argparse
import json


def cmd_tune(args: argparse.Namespace) -> int:
    """Handler of ``arpo tune``: load and validate the whole sweep, then run it (or print it with --dry-run)."""
    import logging
    import os

    from arpo_algo.run.sweep import describe, load_sweep

    logging.getLogger("ray.rllib").setLevel(logging.ERROR)  # the "new API stack" banner is noise here

    overrides = list(args.set or [])
    if args.output:
        overrides.append(f"sweep.output={json.dumps(args.output)}")
    if os.environ.get("RAY_ADDRESS") and not args.dry_run:
        from arpo_algo.run.sweep_run import start_ray

        start_ray()  # resources are then checked against the cluster
    sweep = load_sweep(args.sweep, overrides)
    info = describe(sweep)
    for note in sweep.notes:
        print(f"note: {note}", flush=True)
    if args.dry_run:
        print(json.dumps(info, indent=2, default=str))
        return 0
    from arpo_algo.run.sweep_run import report_sweep, run_sweep

    if args.report:
        summary = report_sweep(sweep)
        print(f"[tune] reports of {summary['trials']} finished trial(s) written to {sweep.output_dir}")
        return 0

    print(
        f"[tune] {info['total_trials']} trial(s) ({', '.join(f'{a}: {n}' for a, n in info['trials'].items())}) "
        f"x up to {sweep.settings.iterations} iterations -> {sweep.output_dir}",
        flush=True,
    )
    summary = run_sweep(sweep, resume=args.resume)
    if summary.get("interrupted"):
        return 130
    best = summary["best"]
    print(
        f"[tune] {summary['trials']} trials, {summary['stopped_early']} stopped early, {summary['failed']} failed, "
        f"{summary['wall_s']:.0f} s"
    )
    if best:
        print(f"[tune] best: {best['trial']} {sweep.settings.metric}={best[sweep.settings.metric]}")
    print(summary["best_toml"] or str(sweep.output_dir / "results.md"))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo tune``."""
    p = sub.add_parser(
        "tune",
        help="sweep ARPO/AEPO/GRPO knobs with Ray Tune (Optuna, ASHA, seed grids)",
        description="Run a sweep file (a path, or a name in experiments/): validate every point, "
        "run the trials with Ray Tune, write results.md/csv, summary.md, plots and "
        "best.toml into the sweep folder.",
    )
    p.add_argument("sweep", help="sweep TOML file or its name in experiments/ (e.g. tune_quickstart)")
    p.add_argument("--output", help="sweep folder (default: [sweep] output, else runs/tune/<name>)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted sweep in its folder (finished trials are not rerun)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override a sweep setting (sweep.num_samples=2) or a base experiment setting "
        "(rollouts.max_response_tokens=64); repeatable; values are TOML literals",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="only write the reports of the sweep folder as it stands (finished trials; e.g. after Ctrl-C)",
    )
    p.add_argument("--dry-run", action="store_true", help="validate, print the resolved space and trial count, exit")
    p.set_defaults(func=cmd_tune)
