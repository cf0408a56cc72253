"""``arpo checkpoint convert``: rewrite a checkpoint of RLlib's former pickled layout as a data-only one, once, for a
folder the user vouches for (reading the old layout unpickles its files, which can run any code)."""

from __future__ import annotations

import argparse


def cmd_convert(args: argparse.Namespace) -> int:
    """Handler of ``arpo checkpoint convert``."""
    from pathlib import Path

    from arpo_algo.algorithms.checkpoint import convert_legacy_checkpoint

    src = Path(args.source)
    dest = Path(args.output) if args.output else src.with_name(f"{src.name}_converted")
    print(convert_legacy_checkpoint(src, dest, trust_pickles=args.trust_pickles))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo checkpoint``."""
    cmds = sub.add_parser("checkpoint", help="convert checkpoints of an earlier arpo").add_subparsers(
        dest="checkpoint_cmd", required=True)
    p = cmds.add_parser("convert", help="rewrite a checkpoint of the former pickled layout as a data-only one",
                        description="Reads a checkpoint written by an earlier arpo (RLlib's layout with .pkl files) "
                                    "and writes it in the current data-only layout. Reading the old layout "
                                    "unpickles its files, which can run any code: only for folders you trust.")
    p.add_argument("source", help="the old checkpoint folder (e.g. runs/x/checkpoints/iter_000010)")
    p.add_argument("--output", help="the new checkpoint folder (default: <source>_converted beside it); to resume "
                                    "a run from it, put it in the run's checkpoints/ folder as iter_N")
    p.add_argument("--trust-pickles", action="store_true",
                   help="confirm that you trust whoever wrote the folder (required: its files are unpickled)")
    p.set_defaults(func=cmd_convert)
