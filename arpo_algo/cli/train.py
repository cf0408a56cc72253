"""``arpo train``: run an experiment file in-process (see :mod:`arpo_algo.run.driver` for the run folder)."""

from __future__ import annotations

import argparse
import json
import logging


def cmd_train(args: argparse.Namespace) -> int:
    """Handler of ``arpo train``."""
    from arpo_algo.run.experiment import experiment_record, load_experiment

    logging.getLogger("ray.rllib").setLevel(logging.ERROR)  # the "new API stack" banner is noise here
    exp = load_experiment(args.experiment, args.set or [])
    if args.dry_run:
        exp.config.validate()
        lora = exp.config.settings.model.lora
        if lora.enabled:  # the target modules against the model's config (no weight is read)
            from arpo_algo.models import resolve_model_path
            from arpo_algo.models.lora import resolve_targets

            resolve_targets(lora, resolve_model_path(exp.config.settings.model.path))
        print(json.dumps(experiment_record(exp), indent=2, default=repr))
        return 0
    from arpo_algo.run.driver import train_experiment

    summary = train_experiment(exp, output=args.output, resume=args.resume, progress=not args.no_progress,
                               allow_unisolated_python=args.allow_unisolated_python)
    shown = {k: summary[k] for k in ("accuracy_before", "accuracy_after", "time_s", "checkpoint")}
    print(json.dumps(shown, indent=2))
    print(summary["policy"] or summary["output"])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo train``."""
    p = sub.add_parser("train", help="train with ARPO/AEPO/GRPO from an experiment file",
                       description="Run an experiment file (a path, or a name looked up in $ARPO_EXPERIMENTS, "
                                   "./experiments, then the source checkout's experiments/) in-process.")
    p.add_argument("experiment", help="experiment TOML file or its name (e.g. quickstart)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override one setting, e.g. --set tree.budget=8 (repeatable; values are TOML literals, "
                        "bare words are strings)")
    p.add_argument("--output", help="run folder (default: [experiment] output, else runs/<name>)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--allow-unisolated-python", action="store_true",
                   help="run the Python tool below the 'process' isolation level (the model's code may reach the "
                        "network or act as this user); recorded in the run folder's sandbox.json")
    p.set_defaults(func=cmd_train)
