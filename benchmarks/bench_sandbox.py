"""Per-call latency of the Python tool's sandbox backends, side by side in one run: the calls alternate between the
backends (round robin), so a busy machine slows each alike; the figure to quote is the ratio to bwrap.

Run: ``python -m benchmarks.bench_sandbox --backends bwrap docker --calls 20`` (prints a markdown table; the docker
backend needs an engine holding the sandbox image, ``arpo sandbox build-image``).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from pathlib import Path

from arpo_env.tools.python_tool import PythonTool

CODE = "sum(i * i for i in range(1000))"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    return " ".join(sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|amx[a-z_0-9]*)\b", text)))) or "no avx512/amx"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["bwrap", "docker"],
        choices=["subprocess", "bwrap", "docker"],
        help="the first one is the reference of the ratios",
    )
    parser.add_argument("--calls", type=int, default=20, help="calls per backend (after one warm-up call each)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    tools = {b: PythonTool(timeout_s=30, backend=b) for b in args.backends}
    setup_s = time.perf_counter() - start
    times: dict[str, list[float]] = {b: [] for b in args.backends}
    for tool in tools.values():
        assert not tool(CODE).error  # warm-up
    for _ in range(args.calls):
        for backend, tool in tools.items():
            t0 = time.perf_counter()
            result = tool(CODE)
            times[backend].append(time.perf_counter() - t0)
            assert not result.error and result.text == "332833500", result.text
    ref = statistics.median(times[args.backends[0]])
    rows = {
        b: {
            "median_ms": 1e3 * statistics.median(t),
            "p90_ms": 1e3 * sorted(t)[int(0.9 * (len(t) - 1))],
            "ratio_to_" + args.backends[0]: statistics.median(t) / ref,
            "level": tools[b].isolation["level"],
        }
        for b, t in times.items()
    }
    out = {
        "machine": platform.platform(),
        "cpu_flags": _cpu_flags(),
        "calls": args.calls,
        "setup_s_all_backends": setup_s,
        "backends": rows,
    }
    ratio = "ratio_to_" + args.backends[0]
    print(f"| backend | level | median ms | p90 ms | {ratio} |\n|---|---|---|---|---|")
    for b, r in rows.items():
        print(f"| {b} | {r['level']} | {r['median_ms']:.0f} | {r['p90_ms']:.0f} | {r[ratio]:.2f} |")
    print(f"machine: {out['machine']}; CPU flags: {out['cpu_flags']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
