"""The ``arpo`` command line: one module per command in this package, registered explicitly below, then the
commands other packages declare in the ``arpo.commands`` entry-point group (:mod:`arpo_algo.cli.commands`; the server's
``arpo serve`` and ``arpo view`` come that way, since this room may not import the server's).

Each command module has a ``register(subparsers)`` function; heavy imports (torch, transformers, ray) happen inside
the handlers so ``arpo --help`` and ``arpo env list`` stay fast. User mistakes raise :class:`ArpoError` and are
printed as one line plus a hint with exit code 2; ``--verbose`` adds the traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from arpo_algo import __version__
from arpo_algo.cli import commands, doctor, env_data, export, model, quickstart, sandbox, sft, train, tune
from arpo_algo.cli import eval as eval_cli
from arpo_base.errors import ArpoError

#: Built-in command modules in --help order (``env_data`` adds ``env`` and ``data``); the entry-point commands follow.
COMMANDS = (doctor, quickstart, model, env_data, sft, train, tune, eval_cli, export, sandbox)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arpo", description="Agentic RL (ARPO/AEPO/GRPO) for tool-using LLMs.")
    parser.add_argument("--version", action="version", version=f"arpo {__version__}")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    commands.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ArpoError as e:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
