"""``arpo train``: run an experiment file in-process (see :mod:`arpo_algo.run.driver` for the run folder)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any


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

    viewer = _start_viewer(exp, args) if args.view else None
    try:
        summary = train_experiment(
            exp,
            output=args.output,
            resume=args.resume,
            progress=not args.no_progress,
            allow_unisolated_python=args.allow_unisolated_python,
        )
    finally:
        if viewer is not None:
            viewer.terminate()
            viewer.wait(10)
    shown = {k: summary[k] for k in ("accuracy_before", "accuracy_after", "time_s", "checkpoint")}
    print(json.dumps(shown, indent=2))
    print(summary["policy"] or summary["output"])
    return 0


def _start_viewer(exp: Any, args: argparse.Namespace) -> subprocess.Popen:
    """``arpo view`` on the run's tree folder in a child process (stopped with the training), its address printed."""
    from arpo_algo.eval.trees import FOLDER, start_folder
    from arpo_base.errors import ArpoError

    rollouts = exp.config.settings.rollouts
    if not rollouts.record_trees:
        raise ArpoError(
            "--view shows the recorded trees, and rollouts.record_trees is false",
            hint="drop --set rollouts.record_trees=false, or drop --view",
        )
    from arpo_base.ports import check_port

    check_port("127.0.0.1", args.view_port)
    out = Path(args.resume or args.output or exp.output_dir).expanduser()
    folder = start_folder(Path(rollouts.record_path) if rollouts.record_path else out / FOLDER)
    chosen = os.environ.get("ARPO_VIEW_KEY", "").strip()  # the viewer's own variable, never the serving key
    key = chosen or secrets.token_urlsafe(24)
    proc = subprocess.Popen(
        [sys.executable, "-m", "arpo_algo.cli", "view", str(folder), "--port", str(args.view_port)],
        env=dict(os.environ, ARPO_VIEW_KEY=key),
        stdout=subprocess.DEVNULL,
    )
    fragment = "#key=<ARPO_VIEW_KEY>" if chosen else f"#key={key}"  # a key the user chose is never printed
    print(
        f"viewer: http://127.0.0.1:{args.view_port}/{fragment} (stops with the training; `arpo view {out}` "
        "shows the run afterwards)",
        flush=True,
    )
    return proc


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo train``."""
    p = sub.add_parser(
        "train",
        help="train with ARPO/AEPO/GRPO from an experiment file",
        description="Run an experiment file (a path, or a name looked up in $ARPO_EXPERIMENTS, "
        "./experiments, then the source checkout's experiments/) in-process.",
    )
    p.add_argument("experiment", help="experiment TOML file or its name (e.g. quickstart)")
    p.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one setting, e.g. --set tree.budget=8 (repeatable; values are TOML literals, "
        "bare words are strings)",
    )
    p.add_argument("--output", help="run folder (default: [experiment] output, else runs/<name>)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--allow-unisolated-python",
        action="store_true",
        help="run the Python tool below the 'process' isolation level (the model's code may reach the "
        "network or act as this user); recorded in the run folder's sandbox.json",
    )
    p.add_argument(
        "--view",
        action="store_true",
        help="serve the rollout-tree viewer (arpo view) on 127.0.0.1 while the run trains",
    )
    p.add_argument("--view-port", type=int, default=8765, help="the viewer's port (default 8765)")
    p.set_defaults(func=cmd_train)
