"""``arpo quickstart``: pull SmolLM2-135M-Instruct, SFT, ARPO, held-out evaluation, export.

The stages live in :mod:`arpo_algo.run.quickstart`."""

from __future__ import annotations

import argparse


def cmd_quickstart(args: argparse.Namespace) -> int:
    from arpo_algo.run.quickstart import run

    return run(args)


def register(sub: argparse._SubParsersAction) -> None:
    from arpo_algo.run.quickstart import add_arguments

    p = sub.add_parser(
        "quickstart",
        help="the quickstart: pull SmolLM2-135M -> SFT -> ARPO -> evaluate -> export",
        description="Pull SmolLM2-135M-Instruct, fine-tune it on generated ToolMath demonstrations, "
        "train it with ARPO, evaluate both checkpoints on held-out tasks and export the "
        "policy as a plain Hugging Face folder. A second run skips finished stages.",
    )
    add_arguments(p)
    p.set_defaults(func=cmd_quickstart)
