"""N LoRA agents on one base against N full-weight agents, as ``arpo serve`` runs them in a replica.

    python -m benchmarks.bench_multi_lora [--model tiny|smollm2-135m-instruct|FOLDER] [--agents 1 4 8]
                                          [--clients 1 32] [--tokens 16] [--rank 16] [--out FILE]

For each N, two variants, each in a fresh process of its own (so its resident memory is its own), one after the
other: ``shared`` (one HF engine over the base with the N adapters loaded by name, behind one batching front:
requests of different agents decode in one batch) and ``separate`` (one engine per agent, each loading its adapter
folder on its own copy of the base, each behind its own front: what ``arpo serve`` did before). The adapters are
random rank-``--rank`` adapters on the attention and MLP projections made here. A process reports the resident
memory its engines added, then for each client count C runs C threads, each sending requests (greedy,
``--tokens`` new tokens after a 64-token prompt) to the agents in turn for ``--seconds``: throughput (generated
tokens per second over all clients) and the mean request latency. ``shared`` also times adding one more agent live
(its adapter loaded between rounds while the C clients run), the step ``POST /v1/agents`` waits for in a replica.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _base(model: str, root: Path) -> Path:
    from arpo_algo.models import build_tiny_model, resolve_model_path

    if model == "tiny":
        return build_tiny_model(root / "base", num_layers=4, hidden_size=256, seed=0)
    return Path(resolve_model_path(model))


def measure(args: argparse.Namespace) -> dict:
    """One variant with N agents, in this process."""
    import torch

    from arpo_algo.rollout.engines.base import GenRequest, SamplingParams
    from arpo_algo.rollout.engines.hf.engine import HFEngine
    from serve.batching import BatchingEngine

    torch.set_num_threads(args.threads)
    root = Path(args.workdir)
    base = _base(args.model, root)
    adapters = [root / f"adapter_{i}" for i in range(args.n + 1)]
    before = _rss_mib()
    t0 = time.perf_counter()
    if args.variant == "shared":
        engine = HFEngine(str(base), adapters={f"a{i}": str(adapters[i]) for i in range(args.n)})
        front = BatchingEngine(engine)
        views = [front.view(None, f"a{i}") for i in range(args.n)]
        fronts = [front]
    else:
        fronts = [BatchingEngine(HFEngine(str(adapters[i]))) for i in range(args.n)]
        views = [f.view(None) for f in fronts]
    load_s = time.perf_counter() - t0
    prompt = list(range(100, 164))
    greedy = SamplingParams(max_new_tokens=args.tokens, temperature=0.0)
    for v in views:  # warm-up: the transposed weight copies are made on the first call
        v.generate([GenRequest(0, prompt, greedy)])
    loaded = _rss_mib()
    out: dict = {
        "variant": args.variant,
        "agents": args.n,
        "memory_mib": round(loaded - before, 1),
        "load_s": round(load_s, 2),
        "clients": {},
    }
    for clients in args.clients:
        out["clients"][str(clients)] = _load_phase(views, prompt, greedy, clients, args.seconds)
    if args.variant == "shared":  # adding one more agent while the most clients run (not counted above)
        timed: dict = {}

        def add() -> None:
            time.sleep(min(1.0, args.seconds / 4))
            a = time.perf_counter()
            front.between_rounds(lambda: engine.add_adapter("extra", str(adapters[args.n])))
            timed["add_agent_s"] = round(time.perf_counter() - a, 3)

        adder = threading.Thread(target=add)
        adder.start()
        _load_phase(views, prompt, greedy, max(args.clients), args.seconds)
        adder.join()
        out.update(timed)
    for f in fronts:
        f.close()
    return out


def _load_phase(views: list, prompt: list[int], params: object, clients: int, seconds: float) -> dict:
    """``clients`` threads sending requests to the agents in turn for ``seconds``: throughput and mean latency."""
    from arpo_algo.rollout.engines.base import GenRequest

    lat: list[float] = []
    tokens = [0]
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client(c: int) -> None:
        k = c
        while time.perf_counter() < stop:
            t = time.perf_counter()
            g = views[k % len(views)].generate([GenRequest(0, prompt, params)])[0]
            with lock:
                lat.append(time.perf_counter() - t)
                tokens[0] += len(g.token_ids)
            k += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    return {
        "tokens_per_s": round(tokens[0] / wall, 1),
        "mean_latency_s": round(statistics.mean(lat), 3),
        "requests": len(lat),
    }


def prepare(args: argparse.Namespace, workdir: Path) -> None:
    """The base (tiny: made here) and max(N) + 1 random adapters of it."""
    from arpo_algo.models import build_tiny_adapter

    base = _base(args.model, workdir)
    for i in range(max(args.agents) + 1):
        build_tiny_adapter(base, workdir / f"adapter_{i}", rank=args.rank, seed=i + 1, scale=0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="tiny", help="tiny (4 layers, hidden 256, made here), a registered name or a folder"
    )
    p.add_argument("--agents", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0, help="per client count")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    p.add_argument("--out", default=None)
    p.add_argument("--variant", choices=("shared", "separate"), help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:  # a child process: one variant
        print(json.dumps(measure(args)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepare(args, Path(tmp))
        for n in args.agents:
            for variant in ("shared", "separate"):
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.bench_multi_lora",
                    "--variant",
                    variant,
                    "--n",
                    str(n),
                    "--workdir",
                    tmp,
                    "--model",
                    args.model,
                    "--tokens",
                    str(args.tokens),
                    "--seconds",
                    str(args.seconds),
                    "--threads",
                    str(args.threads),
                    "--clients",
                    *map(str, args.clients),
                ]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), flush=True)
    report = {"model": args.model, "rank": args.rank, "tokens": args.tokens, "rows": rows, "ratios": []}
    for n in args.agents:
        s, f = [next(r for r in rows if r["agents"] == n and r["variant"] == v) for v in ("shared", "separate")]
        ratio = {"agents": n, "memory_shared_over_separate": round(s["memory_mib"] / max(f["memory_mib"], 1e-9), 3)}
        for c in map(str, args.clients):
            ratio[f"throughput_shared_over_separate_c{c}"] = round(
                s["clients"][c]["tokens_per_s"] / f["clients"][c]["tokens_per_s"], 2
            )
            ratio[f"latency_shared_over_separate_c{c}"] = round(
                s["clients"][c]["mean_latency_s"] / f["clients"][c]["mean_latency_s"], 2
            )
        report["ratios"].append(ratio)
        print(json.dumps(ratio))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
