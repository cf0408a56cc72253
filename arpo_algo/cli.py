"""The ``arpo`` command line.

Every subcommand lives in a small ``register(subparsers)`` function; heavy imports (torch, transformers, ray) happen
inside the handlers so ``arpo --help`` and ``arpo env list`` stay fast. User mistakes raise :class:`ArpoError` and are
printed as one line plus a hint with a non-zero exit code; ``--verbose`` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import platform
import sys
import traceback
from collections.abc import Callable

from arpo_env.errors import ArpoError

# Modules that contribute subcommands through a ``register(subparsers)`` function, in --help order.
SUBCOMMAND_MODULES = [
    "arpo_algo.cli",  # doctor, model
    "arpo_env.cli",  # env, data
    "arpo_algo.cli_train",  # train, sft
]


def _version() -> str:
    try:
        return md.version("arpo")
    except md.PackageNotFoundError:
        return "0+unknown"


def _pkg_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------------------------------- doctor


def doctor_report() -> dict:
    """What this machine offers arpo, read truthfully from the installed packages and the OS."""
    from arpo_env.paths import arpo_home

    report: dict = {
        "arpo": _version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": {p: _pkg_version(p) for p in ("torch", "ray", "transformers", "gymnasium", "vllm", "deepspeed")},
    }
    try:
        import torch

        cuda = torch.cuda.is_available()
        report["gpu"] = {
            "cuda_available": cuda,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            "torch_cuda_build": torch.version.cuda,
        }
    except ImportError:
        report["gpu"] = {"cuda_available": False, "devices": [], "torch_cuda_build": None, "note": "torch missing"}
    try:
        from arpo_env.tools.python_tool import sandbox_capabilities

        report["python_tool_sandbox"] = sandbox_capabilities()
    except ImportError as e:  # the tool module is part of arpo_env; this only happens in a broken install
        report["python_tool_sandbox"] = {"error": str(e)}
    from arpo_algo.models import list_models

    report["arpo_home"] = str(arpo_home())
    report["models"] = list_models()
    return report


def _print_doctor(r: dict) -> None:
    print(f"arpo {r['arpo']}  python {r['python']}  ({r['platform']}, {r['cpus']} CPUs)")
    for name, ver in r["packages"].items():
        print(f"  {name:<13} {ver or 'not installed'}")
    gpu = r["gpu"]
    if gpu["cuda_available"]:
        print(f"  GPU          {', '.join(gpu['devices'])} (CUDA {gpu['torch_cuda_build']})")
    else:
        build = "CPU-only torch build" if not gpu.get("torch_cuda_build") else f"CUDA {gpu['torch_cuda_build']} build"
        print(f"  GPU          none ({build}); training and rollouts run on the CPU")
    sb = r["python_tool_sandbox"]
    if "error" in sb:
        print(f"  python tool  unavailable: {sb['error']}")
    else:
        net = "isolated" if sb.get("network_isolation") else "NOT isolated"
        print(f"  python tool  backend {sb.get('backend')}, network {net}: {sb.get('detail', '')}")
    print(f"  model cache  {r['arpo_home']}/models")
    for m in r["models"]:
        state = f"pulled, {m['size_mb']} MB" if m["pulled"] else "not pulled"
        print(f"    {m['name']:<24} {state}  {m['path'] if m['pulled'] else ''}")


def cmd_doctor(args: argparse.Namespace) -> int:
    r = doctor_report()
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        _print_doctor(r)
    return 0


# ------------------------------------------------------------------------------------------------------ model


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
    p = sub.add_parser("doctor", help="report versions, CPU/GPU, sandbox isolation and the model cache")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_doctor)

    model = sub.add_parser("model", help="pull and list models").add_subparsers(dest="model_cmd", required=True)
    p = model.add_parser("pull", help="fetch a registered model into the local cache (prints its folder last)")
    p.add_argument("name", help="registered model name, e.g. smollm2-135m-instruct")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_model_pull)
    p = model.add_parser("list", help="registered and cached models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_model_list)


# ------------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arpo", description="Agentic RL (ARPO/AEPO/GRPO) for tool-using LLMs.")
    parser.add_argument("--version", action="version", version=f"arpo {_version()}")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for modname in SUBCOMMAND_MODULES:
        reg: Callable[[argparse._SubParsersAction], None] = importlib.import_module(modname).register
        reg(sub)
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
