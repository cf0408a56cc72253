"""Benchmark: one learner step of the quickstart's model under each learner backend on CPU, side by side in one run:
``local`` (one process), ``ddp``, DeepSpeed ZeRO-2 and ZeRO-3 (two ranks each).

    python -m benchmarks.bench_learner_backends --out results.json
    python -m benchmarks.bench_learner_backends --model TINY_MODEL_DIR --groups 2 --steps 1   (the test)

Every backend gets the same update: ``--groups`` synthetic ARPO-shaped groups (:func:`arpo_algo.rollout.synthetic.
make_group`, 6 trajectories each: a 60-token prompt, a 40-token shared prefix, 2 branches with 2 leaves each) at the
same learner settings and seed. Each configuration uses the machine's two cores: the local learner runs in a Ray actor
with 2 torch threads, each data-parallel rank with 1; ``local-1t`` is the local learner with 1 thread (one core, as
one rank has), which shows what a busy machine does to a two-thread process. The backends run one after another
(their memory does not fit together on a small machine), in reversed order on every other round; each is built, takes
one warm-up step, then ``--steps`` timed steps. Reported per backend: the median step time (wall time of ``update``,
as the caller sees it) and its ratio to the first backend's, and each rank's peak resident memory during the timed
steps (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; Linux only). The machine line names the CPU
flags and torch version.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

from arpo_base.ray_start import init_ray

BACKENDS = {
    "local": {"learner_backend": "local"},
    "local-1t": {"learner_backend": "local"},  # the same with one torch thread: one core, as each rank has
    "ddp": {"learner_backend": "ddp", "learner_workers": 2},
    "zero2": {"learner_backend": "deepspeed", "learner_workers": 2, "deepspeed_stage": 2},
    "zero3": {"learner_backend": "deepspeed", "learner_workers": 2, "deepspeed_stage": 3},
}


def reset_peak() -> None:
    """Reset this process's peak resident memory (VmHWM) to its current resident memory."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_mib() -> float:
    """This process's peak resident memory (VmHWM) in MiB."""
    m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(m.group(1)) / 1024 if m else math.nan


def machine() -> str:
    import platform

    import torch

    flags = sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|amx[a-z_0-9]*)\b", Path("/proc/cpuinfo").read_text())))
    return (
        f"{platform.processor() or platform.machine()}, {len(__import__('os').sched_getaffinity(0))} CPUs, "
        f"flags {' '.join(flags) or 'no avx512/amx'}, torch {torch.__version__}"
    )


class LocalActor:
    """The local learner in its own process (so that its memory is measured like a rank's)."""

    def __init__(self, model: str, config: Any, threads: int) -> None:
        import torch

        from arpo_algo.train.backends import LocalLearner

        torch.set_num_threads(threads)
        self.learner = LocalLearner(model, config, seed=0)

    def step(self, groups: list[Any]) -> float:
        t0 = time.perf_counter()
        self.learner.update(groups)
        return time.perf_counter() - t0

    def reset_peak(self) -> None:
        reset_peak()

    def peak(self) -> float:
        return peak_mib()


def run_backend(name: str, model: str, config: Any, groups: list[Any], steps: int) -> dict[str, Any]:
    import ray

    from arpo_algo.train.backend_config import BackendConfig
    from arpo_algo.train.backends import build_backend

    if name.startswith("local"):
        actor = ray.remote(num_cpus=2)(LocalActor).remote(model, config, 1 if name == "local-1t" else 2)
        try:
            ray.get(actor.step.remote(groups))  # warm-up
            ray.get(actor.reset_peak.remote())
            times = [ray.get(actor.step.remote(groups)) for _ in range(steps)]
            return {"step_s": times, "peak_mib": [ray.get(actor.peak.remote())]}
        finally:
            ray.kill(actor)
    backend = build_backend(model, config, BackendConfig(**BACKENDS[name]), seed=0)
    try:
        backend.update(groups)  # warm-up
        workers = backend._workers
        ray.get([w.__ray_call__.remote(lambda self: reset_peak()) for w in workers])
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            backend.update(groups)
            times.append(time.perf_counter() - t0)
        return {"step_s": times, "peak_mib": ray.get([w.__ray_call__.remote(lambda self: peak_mib()) for w in workers])}
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import os

    import ray

    from arpo_algo.models import resolve_model_path
    from arpo_algo.rollout.synthetic import make_group
    from arpo_algo.train.learner import LearnerConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registered name or HF folder")
    ap.add_argument("--groups", type=int, default=4, help="groups per update")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per backend and round")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the backends (every other one reversed)")
    ap.add_argument(
        "--backends",
        default="local,ddp,zero2,zero3",
        help="comma-separated, from " + ",".join(BACKENDS) + " (the first is the ratios' base)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    names = args.backends.split(",")
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        ap.error(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    model = str(resolve_model_path(args.model))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    rng = random.Random(0)
    groups = [
        make_group(rng, vocab, i, prompt_len=60, prefix_len=40, width=2, children=2, branch=(20, 40))
        for i in range(args.groups)
    ]
    # The synthetic old log-probs are not the model's: the mismatch alarm is off (it is not what is measured).
    config = LearnerConfig(lr=1e-6, kl_rollout_warn=math.inf, kl_rollout_stop=math.inf)
    repo = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    init_ray(  # a Ray of its own (or RAY_ADDRESS's), never the one a stale ray_current_cluster file names
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    results: dict[str, dict[str, list[float]]] = {n: {"step_s": [], "peak_mib": []} for n in names}
    try:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                got = run_backend(name, model, config, groups, args.steps)
                results[name]["step_s"] += got["step_s"]
                results[name]["peak_mib"] = (
                    [max(a, b) for a, b in zip(results[name]["peak_mib"], got["peak_mib"])]
                    if results[name]["peak_mib"]
                    else got["peak_mib"]
                )
                print(
                    f"round {r}: {name}: steps {[round(t, 2) for t in got['step_s']]} s, peak per rank "
                    f"{[round(m) for m in got['peak_mib']]} MiB",
                    flush=True,
                )
    finally:
        ray.shutdown()
    base = statistics.median(results[names[0]]["step_s"])
    out = {
        "machine": machine(),
        "model": args.model,
        "groups": args.groups,
        "tokens": sum(len(g.prompt_ids) + sum(len(t.response_ids) for t in g.trajectories) for g in groups),
        "date": time.strftime("%Y-%m-%d"),
        "backends": {},
    }
    print(f"\n{out['machine']}; {args.model}, {args.groups} groups; ratios against {names[0]}")
    print(f"{'backend':8} {'median step s':>14} {'ratio':>7} {'peak MiB per rank':>20}")
    for name in names:
        med = statistics.median(results[name]["step_s"])
        out["backends"][name] = {"median_step_s": med, "ratio": med / base, **results[name]}
        peaks = " / ".join(f"{m:.0f}" for m in results[name]["peak_mib"])
        print(f"{name:8} {med:14.2f} {med / base:7.2f} {peaks:>20}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
