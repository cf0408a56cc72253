"""The sync/async benchmark on a cluster of its own (``--local-cluster``): the rollout actor runs on a worker node, the
learner in the driver, both modes train, and every process of that cluster is gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from arpo_algo.run.local_cluster import RAY_START


def cluster_processes() -> set[int]:
    """Processes of a cluster the benchmark starts: its ``ray start`` nodes and what they spawned (raylet, workers)."""
    found = set()
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            env = p.info["environ"] or {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if RAY_START.splitlines()[0] in cmd or "arpo-mn-" in env.get("RAY_TMPDIR", ""):
            found.add(p.info["pid"])
    return found


def test_bench_async_samples_on_a_worker_node_and_learns_in_the_driver(tiny_model_dir, tmp_path):
    before = cluster_processes()
    out = tmp_path / "a.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_async",
            "--local-cluster",
            "--model",
            str(tiny_model_dir),
            "--prompts",
            "1",
            "--budget",
            "2",
            "--max-response-tokens",
            "8",
            "--warmup",
            "1",
            "--iterations",
            "1",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # SIGTERM: the benchmark stops its cluster on the way out
            proc.terminate()
            output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-6000:]
    result = json.loads(out.read_text())
    assert result["ratio_sync_over_async"] > 0
    for mode, staleness in (("sync", 0.0), ("async", 1.0)):
        [run] = result["runs"][mode]
        assert run["iterations"][0]["staleness_max"] == staleness
        where = run["placement"]
        [actor_node] = where["rollout_actors"]
        assert where["nodes"][actor_node].get("node_a") == 1.0 and actor_node != where["driver"], where
        assert where["learner_ranks"] == []  # the learner is the driver's
        assert run["iterations"][0]["kl_rollout"] < 1e-6  # the remote actor samples with the learner's weights
    assert cluster_processes() <= before  # nothing of the benchmark's cluster is left behind
