"""``arpo sandbox build-image``: build the Docker sandbox backend's image from this machine's Debian package
sources (no container registry), see :mod:`arpo_env.tools.sandbox_docker`."""

from __future__ import annotations

import argparse
import json


def cmd_build_image(args: argparse.Namespace) -> int:
    from arpo_env.tools.sandbox_docker import DEFAULT_IMAGE, build_image

    info = build_image(tag=args.tag or DEFAULT_IMAGE, mirror=args.mirror, suite=args.suite, rebuild=args.rebuild)
    if args.json:
        print(json.dumps(info))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo sandbox`` and its subcommands (arpo_env is imported by the handler: ``arpo --help`` stays fast)."""
    p = sub.add_parser("sandbox", help="the Python tool's sandbox: build the Docker backend's image")
    cmds = p.add_subparsers(dest="sandbox_command", required=True, metavar="SUBCOMMAND")
    b = cmds.add_parser(
        "build-image",
        help="build the Docker sandbox image from this machine's Debian package "
        "sources (debootstrap; needs root and a Docker engine)",
    )
    b.add_argument(
        "--tag",
        default=None,
        help="image tag (default: the versioned arpo-sandbox tag that the docker "
        "backend uses unless tools.python.docker_image names another)",
    )
    b.add_argument("--mirror", default=None, help="Debian mirror URL (default: the one apt uses for this release)")
    b.add_argument("--suite", default=None, help="Debian release (default: this machine's, e.g. bookworm)")
    b.add_argument("--rebuild", action="store_true", help="build even if the tag is already in the engine")
    b.add_argument("--json", action="store_true", help="print what was built as JSON")
    b.set_defaults(func=cmd_build_image)
