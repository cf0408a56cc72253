"""Persistent interpreters: what a fork at a branch point costs against the alternative, re-running the parent's calls
from scratch, by call depth; and the memory of N live interpreters. Side by side in one run; the figures to quote are
the ratios (replay / fork) and the memory per interpreter.

For each depth d the parent runs d calls (each one imports a module and computes a value the next call uses), then:
``fork``: the parent forks and the child's first call reads the state; ``replay``: a stateless call runs the d calls'
code again, then reads it (what a stateless tool pays to get the same state back). The rounds alternate, so a busy
machine slows both alike. Memory: proportional set size (PSS, shared pages split among their users) of every process
of the sandboxes, for N forks of one interpreter holding ``--array-mb`` of data, and for N fresh interpreters.

Run: ``python -m benchmarks.bench_fork --depths 1 2 4 8 --rounds 5 --live 1 8 32`` (bwrap; root for the memory part,
which reads the sandbox uids' processes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from arpo_env.tools.python_tool import PythonTool
from benchmarks.bench_sandbox import _cpu_flags

STEP = "import statistics as st{k}\nv{k} = st{k}.fmean(i * i % 97 for i in range(200_000)) + {prev}\n"
READ = "print(round(v{k}, 3))"


def _calls(d: int) -> list[str]:
    return [STEP.format(k=k, prev=f"v{k - 1}" if k else "0") for k in range(d)]


def _sandbox_pss_kb(lo: int, hi: int) -> int:
    """Summed PSS (kB) of every live process whose uid is in [lo, hi): the persistent sandboxes' processes."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
            if lo <= uid < hi:
                with open(f"/proc/{entry}/smaps_rollup") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration, ValueError):
            continue
    return total


def fork_vs_replay(tool: PythonTool, stateless: PythonTool, depths: list[int], rounds: int) -> dict:
    rows = {}
    for d in depths:
        fork_s, replay_s = [], []
        for _ in range(rounds):
            parent = tool.open_interpreter()
            for code in _calls(d):
                assert not parent(code).error
            t0 = time.perf_counter()
            child = parent.fork()
            forked = child(READ.format(k=d - 1))
            fork_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            replayed = stateless("".join(_calls(d)) + READ.format(k=d - 1))
            replay_s.append(time.perf_counter() - t0)
            assert not forked.error and forked.text == replayed.text, (forked.text, replayed.text)
            child.close()
            parent.close()
        f, r = statistics.median(fork_s), statistics.median(replay_s)
        rows[d] = {"fork_ms": 1e3 * f, "replay_ms": 1e3 * r, "replay_over_fork": r / f}
    return rows


def live_memory(tool: PythonTool, counts: list[int], array_mb: int) -> dict:
    lo, hi = tool.uid_base, tool.uid_base + 256
    rows = {}
    for n in counts:
        parent = tool.open_interpreter()
        assert not parent(f"data = bytearray(range(256)) * ({array_mb} << 12)").error
        forks = [parent.fork() for _ in range(n - 1)]
        for c in forks:
            assert c("len(data)").text.strip() == str(array_mb << 20)
        forked_kb = _sandbox_pss_kb(lo, hi)
        for c in (*forks, parent):
            c.close()
        fresh = [tool.open_interpreter() for _ in range(n)]
        for c in fresh:
            assert not c("x = 1").error
        fresh_kb = _sandbox_pss_kb(lo, hi)
        for c in fresh:
            c.close()
        rows[n] = {
            "forked_mb": forked_kb / 1024,
            "forked_mb_each": forked_kb / 1024 / n,
            "fresh_mb": fresh_kb / 1024,
            "fresh_mb_each": fresh_kb / 1024 / n,
        }
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="bwrap", choices=["bwrap", "subprocess"])
    parser.add_argument("--depths", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5, help="forks (and replays) per depth; the median is kept")
    parser.add_argument("--live", nargs="+", type=int, default=[1, 8, 32], help="interpreter counts for memory")
    parser.add_argument("--array-mb", type=int, default=16, help="data the forked interpreter holds")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if os.environ.get("ARPO_SMOKE") == "1":
        args.depths, args.rounds, args.live, args.array_mb = [1, 2], 1, [1, 2], 1
    # One tree holds every fork: its process cap (max_procs, the zygote and each fork count) must fit the largest N.
    tool = PythonTool(
        backend=args.backend,
        persistent=True,
        timeout_s=60,
        max_interpreters=max(args.live) + 2,
        max_procs=max(args.live) + 8,
    )
    stateless = PythonTool(backend=args.backend, timeout_s=60)
    out = {
        "machine": platform.platform(),
        "cpu_flags": _cpu_flags(),
        "cpus": os.cpu_count(),
        "backend": args.backend,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
        "depths": fork_vs_replay(tool, stateless, args.depths, args.rounds),
    }
    print("| calls before the branch | fork ms | replay ms | replay / fork |\n|---|---|---|---|")
    for d, r in out["depths"].items():
        print(f"| {d} | {r['fork_ms']:.0f} | {r['replay_ms']:.0f} | {r['replay_over_fork']:.1f} |")
    if os.geteuid() == 0 and tool._uid_drop:
        out["memory"] = live_memory(tool, args.live, args.array_mb)
        print(
            f"\n| live interpreters | forked (holding {args.array_mb} MB) MB | per fork MB | fresh MB | "
            "per fresh MB |\n|---|---|---|---|---|"
        )
        for n, r in out["memory"].items():
            print(
                f"| {n} | {r['forked_mb']:.0f} | {r['forked_mb_each']:.1f} | {r['fresh_mb']:.0f} | "
                f"{r['fresh_mb_each']:.1f} |"
            )
    print(f"machine: {out['machine']}; {out['cpus']} CPUs; CPU flags: {out['cpu_flags']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
