"""``arpo model pull|list``: fetch registered models into the local cache and list them."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_model_pull(args: argparse.Namespace) -> int:
    from arpo_algo.models import is_pulled, pull

    already = is_pulled(args.name)
    path = pull(args.name, progress=not args.quiet)
    if already and not args.quiet:
        print(f"{args.name} is already pulled", file=sys.stderr)
    print(path)
    return 0


def cmd_model_list(args: argparse.Namespace) -> int:
    from arpo_algo.models import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for m in rows:
        state = f"pulled ({m['size_mb']} MB)" if m["pulled"] else "not pulled"
        print(f"{m['name']:<24} {state:<20} {m['path']}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo model pull|list``."""
    model = sub.add_parser("model", help="pull and list models").add_subparsers(dest="model_cmd", required=True)
    p = model.add_parser("pull", help="fetch a registered model into the local cache (prints its folder last)")
    p.add_argument("name", help="registered model name, e.g. smollm2-135m-instruct")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_model_pull)
    p = model.add_parser("list", help="registered and cached models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_model_list)
