"""``arpo export --merge``: a LoRA policy (an adapter folder, a checkpoint or a run that holds one) merged into its
base and written as a plain Hugging Face folder (the work is in :mod:`arpo_algo.models.lora`)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from arpo_base.errors import ConfigError


def cmd_export(args: argparse.Namespace) -> int:
    """Handler of ``arpo export``: checks everything, then writes; prints the output folder last."""
    from arpo_algo.models import resolve_model_path
    from arpo_algo.models.card import rewrite_card
    from arpo_algo.models.lora import is_adapter_folder, merge_export

    if not args.merge:
        raise ConfigError(
            "arpo export needs --merge (the only export there is: adapter + base -> one plain folder)",
            hint="arpo export --merge RUN_OR_CHECKPOINT --output DIR",
        )
    folder = resolve_model_path(args.source)  # a run, a checkpoint or an adapter folder; the base is checked here
    if not is_adapter_folder(folder):
        raise ConfigError(
            f"{args.source} holds full weights ({folder}), not a LoRA adapter: nothing to merge",
            hint="serve or evaluate the folder as it is",
        )
    out = merge_export(folder, Path(args.output).expanduser())
    # the merged folder's model card: the policy's, now full weights, saying where it was merged from and how
    command = shlex.join(["arpo", "export", "--merge", str(args.source), "--output", str(args.output)])
    rewrite_card(out, folder, adapter=False, merged_from=str(folder), exported_by=command)
    print(out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo export`` to the main parser's subcommands."""
    p = sub.add_parser(
        "export",
        help="merge a LoRA policy into its base model as a plain Hugging Face folder",
        description="Merge the LoRA adapter of a run, a checkpoint or an adapter folder into the base "
        "model it was trained on (its weights fingerprint checked first) and write a "
        "plain Hugging Face folder that any tool loads.",
    )
    p.add_argument("source", metavar="RUN_OR_CKPT", help="a run folder, a checkpoint or an adapter folder")
    p.add_argument("--merge", action="store_true", help="merge the adapter into the base weights (required)")
    p.add_argument("--output", required=True, help="the folder to write (must not exist or be empty)")
    p.set_defaults(func=cmd_export)
