"""Iteration time of synchronous against asynchronous rollouts, in one run, with Ray rollout actors.

Both modes train the same config from the same seed (ARPO on ToolMath; ``rollouts.num_rollout_actors`` actors, the
learner in this process), one after the other in the order ``--order`` gives (a repeated order such as
``sync,async,async,sync`` spreads drift of a shared machine over both). Each mode runs ``--warmup`` untimed iterations
and then ``--iterations`` timed ones; an iteration's time is the wall time of ``algo.train()``. Reported per mode: the
median and every iteration's time, and the medians of the sampling and the update time; and the ratio
synchronous / asynchronous of the median iteration times (above 1: asynchronous is faster).

    python -m benchmarks.bench_async --model smollm2-135m-instruct --iterations 4 --out async.json

On several Ray nodes: ``--actor-resources '{"node_a": 1}'`` places the rollout actors on the node offering that
resource, while the learner stays in this process (the asynchronous pipeline scores a stale batch under the weights
that sampled it, which only the local learner can swap in), so sampling and update run on different nodes.
``--local-cluster`` starts such a cluster on this machine for the run (a head and workers ``a``/``b`` offering
``node_a``/``node_b``, every address 127.0.0.1; see :mod:`arpo_algo.run.local_cluster`) and places the actors on
``node_a`` unless told otherwise; it is stopped at the end. Each mode's result records where its actors ran
(``placement``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from arpo_algo.algorithms import ARPOConfig


def build_config(args: argparse.Namespace, asynchronous: bool) -> ARPOConfig:
    cfg = (
        ARPOConfig()
        .environment("arpo/ToolMath-v0", env_config={"levels": list(args.levels), "max_tool_calls": 2})
        .training(model_path=args.model, prompts_per_step=args.prompts, lr=2.5e-5, entropy_coef=args.entropy_coef)
        .tree(budget=args.budget, initial=max(1, args.budget // 2))
        .llm_rollouts(
            max_response_tokens=args.max_response_tokens,
            num_rollout_actors=args.actors,
            num_cpus_per_rollout_actor=args.cpus_per_actor,
            asynchronous=asynchronous,
            max_staleness=1,
            actor_resources=(args.actor_resources,) if args.actor_resources else (),
        )
    )
    cfg.seed = args.seed
    return cfg


def run_mode(args: argparse.Namespace, asynchronous: bool) -> dict[str, Any]:
    """Warm-up, then timed iterations of one mode; per-iteration times and the medians of their parts."""
    from arpo_algo.run.recovery import placement

    algo = build_config(args, asynchronous).build_algo()
    where = placement(algo)
    rows = []
    try:
        for i in range(args.warmup + args.iterations):
            t0 = time.perf_counter()
            result = algo.train()
            wall = time.perf_counter() - t0
            if i >= args.warmup:
                rollout, learner = result["rollout"], result["learner"]
                # this iteration's own numbers (RLlib's timers are smoothed over iterations, so they are not used)
                rows.append(
                    {
                        "iteration_s": wall,
                        "sampling_s": rollout["time_total_s"],
                        "update_s": result["tokens_sampled"] / max(result["update_tokens_per_s"], 1e-9),
                        "staleness_max": rollout["staleness_max"],
                        "kl_rollout": learner["kl_rollout"],
                        "optimizer_steps": learner["optimizer_steps"],
                    }
                )
    finally:
        algo.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
    return {"median": med, "iterations": rows, "placement": where}


def resources_arg(text: str) -> dict[str, float]:
    """A JSON table of Ray custom resources, e.g. '{"node_a": 1}'."""
    try:
        table = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}; e.g. '{{\"node_a\": 1}}'") from None
    if not isinstance(table, dict) or not all(isinstance(v, (int, float)) for v in table.values()):
        raise argparse.ArgumentTypeError(f"a table of resource amounts, e.g. '{{\"node_a\": 1}}'; got {text!r}")
    return {str(k): float(v) for k, v in table.items()}


def on_local_cluster(argv: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Run this benchmark (``argv`` without ``--local-cluster``) as a driver of a three-node cluster started here on
    127.0.0.1: head (1 CPU), workers a/b (2 CPUs each, offering node_a/node_b). The driver is a child process because
    Ray reads the switch that keeps a driver's addresses on loopback when it is imported. The cluster is stopped when
    the child ends, fails or this process is terminated."""
    import signal
    import subprocess
    import sys
    import tempfile

    from arpo_algo.run.local_cluster import LocalCluster

    def stop(signum, frame):  # SIGTERM unwinds through the finally below
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    child = [a for a in argv if a != "--local-cluster"]
    if args.actor_resources is None:
        child += ["--actor-resources", '{"node_a": 1}']
    cluster = LocalCluster()
    with tempfile.TemporaryDirectory(prefix="arpo-bench-") as tmp:
        out = args.out or Path(tmp) / "result.json"
        if args.out is None:
            child += ["--out", str(out)]
        proc = None
        try:
            cluster.start({"a": {"node_a": 1.0}, "b": {"node_b": 1.0}}, worker_cpus=2)
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_async", *child], env=cluster.env())
            if proc.wait() != 0:
                raise SystemExit(f"the benchmark's driver failed (exit {proc.returncode}; its output is above)")
            return json.loads(out.read_text())
        finally:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
            cluster.shutdown()
            signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registered model name or HF folder")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per iteration")
    ap.add_argument("--budget", type=int, default=4, help="trajectories per prompt (M); N = M // 2")
    ap.add_argument("--levels", type=int, nargs="+", default=[3])
    ap.add_argument("--max-response-tokens", type=int, default=96)
    ap.add_argument(
        "--entropy-coef",
        type=float,
        default=0.01,
        help="> 0: every update is a real optimizer step (an untrained model rarely earns a reward)",
    )
    ap.add_argument("--actors", type=int, default=1)
    ap.add_argument("--cpus-per-actor", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process (the learner)")
    ap.add_argument(
        "--actor-resources",
        type=resources_arg,
        default=None,
        help="Ray custom resources of each rollout actor (JSON), e.g. '{\"node_a\": 1}'",
    )
    ap.add_argument(
        "--local-cluster",
        action="store_true",
        help="start a three-node Ray cluster on 127.0.0.1 for the run; rollout actors on node_a "
        "unless --actor-resources places them",
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--order", default="sync,async", help="comma-separated modes, run in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    modes = args.order.split(",")
    if unknown := [m for m in modes if m not in runs]:
        ap.error(f"--order: unknown mode {unknown[0]!r} (sync, async)")
    if args.local_cluster:
        return on_local_cluster(argv, args)
    from arpo_algo.run.recovery import join_cluster

    joined = join_cluster()  # RAY_ADDRESS (set by --local-cluster or by the user) names a running cluster
    try:
        for mode in modes:
            runs[mode].append(run_mode(args, asynchronous=mode == "async"))
    finally:
        if joined:
            import ray

            ray.shutdown()
    medians = {
        m: statistics.median(r["iteration_s"] for run in rs for r in run["iterations"]) for m, rs in runs.items() if rs
    }
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "median_iteration_s": medians}
    if len(medians) == 2:
        out["ratio_sync_over_async"] = medians["sync"] / medians["async"]
    print(json.dumps({"median_iteration_s": medians, "ratio_sync_over_async": out.get("ratio_sync_over_async")}))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
