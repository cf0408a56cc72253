"""``arpo train`` on a three-node cluster: rollout actors on the worker nodes, the two gloo learner ranks on two
different nodes, weights synced to the remote actors, resume, placement refused, and a worker node lost mid-run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from arpo_algo.train.learner_config import MISMATCH_LEVELS
from tests.multinode.background import Background

RUN_TIMEOUT_S = 420


def write_experiment(
    tmp_path, model_dir, iterations: int, worker_resources: str, prompts: int = 2, tokens: int = 8
) -> str:
    p = tmp_path / "mn.toml"
    p.write_text(f"""
[experiment]
name = "mn"
iterations = {iterations}
checkpoint_every = 1
keep_checkpoints = 2
restart_wait_s = 120

[model]
path = "{model_dir}"

[env]
id = "arpo/ToolMath-v0"
levels = [1]
max_tool_calls = 1

[tree]
budget = 2
initial = 1

[training]
prompts_per_step = {prompts}
lr = 1e-2              # large: an actor sampling with stale weights would show a KL far above the fp32 floor
entropy_coef = 0.01    # the random model never scores: the bonus keeps a gradient so every update is real

[rollouts]
max_response_tokens = {tokens}
num_rollout_actors = 2
actor_resources = [{{worker = 1}}]
[rollouts.hf]
max_batch_size = 4

[backend]
learner_backend = "ddp"
learner_workers = 2
worker_resources = {worker_resources}
collective_timeout_s = 120   # a rank never waits long for a peer that is gone

[evaluation]
every = 0
""")
    return str(p)


def arpo(cluster, *args: str, log=None):
    """Run ``arpo ARGS`` on the cluster to its end, or beside the test with its output in ``log``."""
    cmd = [sys.executable, "-m", "arpo_algo.cli", *args]
    if log is not None:
        return Background(cmd, cluster.env(), log)
    return subprocess.run(cmd, env=cluster.env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def node_with(placement: dict, node_id: str, resource: str) -> bool:
    return placement["nodes"][node_id].get(resource, 0) > 0


def test_train_across_nodes_and_resume(cluster, tiny_model_dir, tmp_path):
    exp = write_experiment(tmp_path, tiny_model_dir, 2, "[{node_a = 1}, {node_b = 1}]")
    out = tmp_path / "run"
    r = arpo(cluster, "train", exp, "--output", str(out), "--no-progress")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    [where] = json.loads((out / "placement.json").read_text())
    rank_a, rank_b = where["learner_ranks"]
    assert node_with(where, rank_a, "node_a") and node_with(where, rank_b, "node_b") and rank_a != rank_b
    assert all(node_with(where, n, "worker") for n in where["rollout_actors"])
    assert where["driver"] not in where["learner_ranks"] + where["rollout_actors"]  # the head runs no actor
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2]
    # the second iteration samples after an update: only weights synced to the remote actors keep the KL between
    # the sampler's and the learner's log-probs at the fp32 floor
    assert rows[1]["learner/param_change_norm"] > 0
    assert all(r["learner/kl_rollout"] < MISMATCH_LEVELS["fp32"][0] for r in rows)
    assert rows[0]["learner/learner_workers"] == 2

    r = arpo(cluster, "train", exp, "--resume", str(out), "--set", "experiment.iterations=3", "--no-progress")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert [r["iteration"] for r in metrics(out)] == [1, 2, 3]
    assert (out / "checkpoints" / "iter_000003" / "policy").is_dir()
    assert json.loads((out / "result.json").read_text())["restarts"] == []


def test_placement_the_cluster_cannot_satisfy_is_refused(cluster, tiny_model_dir, tmp_path):
    exp = write_experiment(tmp_path, tiny_model_dir, 1, "[{node_a = 1}, {node_c = 1}]")
    r = arpo(cluster, "train", exp, "--output", str(tmp_path / "run"), "--no-progress")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "node_c = 1 (the Ray cluster has 0)" in r.stderr and "node_a" in r.stderr  # missing, and what exists
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any work


def test_worker_node_lost_mid_iteration(cluster, tiny_model_dir, tmp_path):
    # iterations long enough (several seconds of sampling) that the kill lands inside iteration 2
    exp = write_experiment(tmp_path, tiny_model_dir, 3, "[{node_a = 1}, {node_b = 1}]", prompts=4, tokens=64)
    out = tmp_path / "run"
    run = arpo(cluster, "train", exp, "--output", str(out), "--no-progress", log=tmp_path / "train.log")
    try:
        first = out / "checkpoints" / "iter_000001"
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not first.is_dir() and run.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.is_dir(), f"no checkpoint ({'exited' if not run.running() else 'in time'})\n{run.output()[-5000:]}"
        # iteration 2 starts as soon as checkpoint 1 is published; rank 1 and any rollout actor on b die with it
        cluster.nodes["b"].kill()
        # a replacement node with the same resources joins, as a cluster manager would bring one up
        cluster.add_worker("b2", 2, {"node_b": 1.0, "worker": 2.0})
        output = run.finish(RUN_TIMEOUT_S, "the run after its node was lost")
    finally:
        run.stop()
    assert run.proc.returncode == 0, output[-6000:]
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2, 3]  # exactly one line per iteration
    result = json.loads((out / "result.json").read_text())
    timers = [{k: round(v, 1) for k, v in r.items() if k.startswith("timers/")} for r in rows]
    assert len(result["restarts"]) == 1, f"the node was not lost inside an iteration: {timers}\n{output[-3000:]}"
    assert "lost a Ray node or actor" in output
    [restart] = result["restarts"]
    assert restart["resumed_from"] >= 1 and restart["failed_iteration"] in restart["rerun_iterations"]
    assert "\x1b" not in restart["error"] and "Error" in restart["error"]
    assert result["rerun_iterations"] == len(restart["rerun_iterations"])
    after = json.loads((out / "placement.json").read_text())[-1]
    assert node_with(after, after["learner_ranks"][1], "node_b")  # rank 1 is back, on the replacement
