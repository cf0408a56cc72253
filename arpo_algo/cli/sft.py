"""``arpo sft``: cold-start supervised fine-tuning (the work is in :mod:`arpo_algo.train.sft`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from arpo_base.errors import ArpoError
from arpo_base.options import apply_overrides, read_toml


def config_from_args(args: argparse.Namespace) -> Any:
    """TOML file, then ``--set`` overrides, then the dedicated flags (highest priority)."""
    values: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ArpoError(f"SFT config file not found: {path}")
        values = read_toml(path)
    values = apply_overrides(values, args.set or [])  # SFTConfig has no sections: --set key=value
    flags = {
        "model": args.model,
        "data": args.data,
        "output_dir": args.output,
        "epochs": args.epochs,
        "num_examples": args.num_examples,
        "max_steps": args.max_steps,
    }
    values.update({k: v for k, v in flags.items() if v is not None})
    from arpo_algo.run import smoke
    from arpo_algo.train.sft import SFTConfig

    if smoke.smoke():
        smoke.announce("arpo sft")
        values["num_examples"] = smoke.capped(values.get("num_examples"), smoke.SFT_EXAMPLES)

    return SFTConfig.from_dict(values)


def cmd_sft(args: argparse.Namespace) -> int:
    """Handler of ``arpo sft``: prints the checkpoint folder last, like ``arpo model pull``."""
    from arpo_algo.train.sft import run_sft

    metrics = run_sft(config_from_args(args))
    summary = {k: metrics[k] for k in ("final_loss", "first_loss", "steps", "tokens_trained", "time_s", "counts")}
    print(json.dumps(summary, indent=2))
    print(metrics["output_dir"])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo sft`` to the main parser's subcommands."""
    p = sub.add_parser(
        "sft",
        help="cold-start SFT on tool-use demonstrations (tool results masked)",
        description="Supervised fine-tuning on ToolMath demonstrations or a sharegpt/alpaca file; "
        "writes a plain HF folder that `arpo train` can start from.",
    )
    p.add_argument("--config", help="TOML file whose top-level keys are SFTConfig fields")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set lr=1e-5 (no section: SFTConfig is flat; the value is "
        "TOML, a bare word is a string; repeatable)",
    )
    p.add_argument("--model", help="registered model name or local HF folder")
    p.add_argument("--data", help='"toolmath" or a sharegpt/alpaca JSON/JSONL file')
    p.add_argument("--output", help="output folder (the HF checkpoint)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--num-examples", type=int, dest="num_examples")
    p.add_argument("--max-steps", type=int, dest="max_steps")
    p.set_defaults(func=cmd_sft)
