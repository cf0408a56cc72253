"""``arpo env list|check`` and ``arpo data pull`` (registered into the main parser by :mod:`arpo_algo.cli.main`)."""

from __future__ import annotations

import argparse
import json

from arpo_base.errors import ArpoError


def cmd_env_list(args: argparse.Namespace) -> int:
    import arpo_env
    from arpo_env.data import shared_data_dir
    from arpo_env.tasks.registry import TASKS

    data = shared_data_dir()
    for env_id, kwargs in arpo_env.ENV_IDS.items():
        spec = TASKS[kwargs["task"]]
        needs = "needs data" if env_id in arpo_env.DATA_BACKED else "no data needed"
        have = ""
        if env_id in arpo_env.DATA_BACKED:
            have = f" (found at {data})" if data else " (missing: arpo data pull)"
        print(
            f"{env_id:<22} tools={','.join(spec.tools)} reward={spec.reward} max_tool_calls={spec.max_tool_calls} "
            f"{needs}{have}"
        )
    return 0


def cmd_env_check(args: argparse.Namespace) -> int:
    from arpo_env.check import check_all

    config = json.loads(args.config) if args.config else None
    if config is not None and not isinstance(config, dict):
        raise ArpoError("--config must be a JSON object")
    results = check_all(args.ids or None, config)
    for r in results:
        print(f"{r.env_id:<22} {r.status:<8} {r.seconds:5.1f}s  {r.detail}")
    return 1 if any(r.status == "failed" for r in results) else 0


def cmd_data_pull(args: argparse.Namespace) -> int:
    from pathlib import Path

    from arpo_env.data import pull

    dest = pull(
        dest=Path(args.dest) if args.dest else None, from_dir=args.from_dir, timeout=args.timeout, mirror=args.mirror
    )
    print(dest)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``env`` and ``data`` subcommands."""
    env = sub.add_parser("env", help="list and check the registered environments").add_subparsers(
        dest="env_cmd", required=True
    )
    p = env.add_parser("list", help="registered env ids, their tools, reward and data needs")
    p.set_defaults(func=cmd_env_list)
    p = env.add_parser("check", help="check_env + determinism + garbage actions for each id")
    p.add_argument("ids", nargs="*", help="env ids (default: all registered)")
    p.add_argument("--config", help="env config as a JSON object, applied to every id")
    p.set_defaults(func=cmd_env_check)

    data_parser = sub.add_parser("data", help="fetch the ARPO reference datasets")
    data = data_parser.add_subparsers(dest="data_cmd", required=True)
    p = data.add_parser("pull", help="download into $ARPO_HOME/data/arpo, or import from a folder with --from")
    p.add_argument("--from", dest="from_dir", help="import the files from this local folder instead of downloading")
    p.add_argument("--dest", help="target folder (default $ARPO_HOME/data/arpo)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per network connection attempt")
    p.add_argument(
        "--mirror", help="base URL serving the files by name (default $ARPO_DATA_MIRROR or the published URLs)"
    )
    p.set_defaults(func=cmd_data_pull)
