"""``arpo tune`` on a three-node cluster: two trials pinned to different worker nodes by a grid over
``rollouts.actor_resources``, a placement the cluster cannot hold refused before any trial starts, and a worker
node lost mid-trial: Tune restores that trial (``max_failures``) on a replacement node offering the same resource,
while the trial on the other node runs through untouched."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time

RUN_TIMEOUT_S = 420
#: Enough iterations after the first result that the node is lost while its trial still runs.
ITERATIONS = 8


def write_sweep(tmp_path, model_dir, placements: str, max_failures: int = 1) -> str:
    (tmp_path / "base.toml").write_text(f"""
[experiment]
name = "mn_tune"

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
prompts_per_step = 4

[rollouts]
max_response_tokens = 64
num_rollout_actors = 1
[rollouts.hf]
max_batch_size = 4

[evaluation]
every = 0
""")
    p = tmp_path / "mn_sweep.toml"
    p.write_text(f"""
[sweep]
experiment = "{tmp_path / 'base.toml'}"
search = "grid"
scheduler = "none"
iterations = {ITERATIONS}
max_concurrent = 2
max_failures = {max_failures}

[space]
"rollouts.actor_resources" = {{grid = {placements}}}
""")
    return str(p)


def arpo(cluster, *args: str, wait: bool = True):
    cmd = [sys.executable, "-m", "arpo_algo.cli", *args]
    if not wait:
        return subprocess.Popen(cmd, env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=cluster.env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def trials_by_node(out) -> dict[str, object]:
    """Trial folder per pinned resource, read from each trial's own params.json."""
    found = {}
    for params in (out / "arpo").glob("arpo_*/params.json"):
        [table] = json.loads(params.read_text())["rollouts.actor_resources"]
        [resource] = table
        found[resource] = params.parent
    return found


def iterations(trial_dir) -> list[int]:
    path = trial_dir / "result.json"
    rows = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(x)["training_iteration"] for x in rows if x.strip()]


def test_placement_the_cluster_cannot_satisfy_is_refused(cluster, tiny_model_dir, tmp_path):
    sweep = write_sweep(tmp_path, tiny_model_dir, "[[{node_a = 1}], [{node_c = 1}]]")
    r = arpo(cluster, "tune", sweep, "--output", str(tmp_path / "out"))
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "node_c = 1 (the Ray cluster has 0)" in r.stderr and "node_a" in r.stderr  # missing, and what exists
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "arpo").exists()  # refused before any trial


def test_trials_on_two_nodes_and_one_restored_after_its_node_is_lost(cluster, tiny_model_dir, tmp_path):
    sweep = write_sweep(tmp_path, tiny_model_dir, "[[{node_a = 1}], [{node_b = 1}]]")
    out = tmp_path / "out"
    proc = arpo(cluster, "tune", sweep, "--output", str(out), wait=False)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        trial_a = None
        while proc.poll() is None and time.monotonic() < deadline:
            trial_a = trials_by_node(out).get("node_a") if (out / "arpo").is_dir() else None
            if trial_a is not None and iterations(trial_a):
                break
            time.sleep(0.2)
        assert trial_a is not None and iterations(trial_a), (
            proc.stdout.read()[-5000:] if proc.poll() is not None else "no result from the node_a trial in time")
        done_before_kill = iterations(trial_a)
        # the trial's rollout actor can run only on a node offering node_a: it dies with the node
        cluster.nodes["a"].kill()
        # a replacement offering the same resources joins, as a cluster manager would bring one up
        cluster.add_worker("a2", 2, {"node_a": 1.0, "worker": 2.0})
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-6000:]
    trials = trials_by_node(out)
    assert set(trials) == {"node_a", "node_b"}  # one trial pinned to each worker node
    rows = {r["trial"]: r for r in csv.DictReader((out / "results.csv").open())}
    assert all(rows[t.name]["status"] == "done" for t in trials.values()), rows
    assert iterations(trials["node_b"]) == list(range(1, ITERATIONS + 1))
    assert not (trials["node_b"] / "error.txt").exists()  # the other node's trial ran through untouched
    rows_a = [json.loads(x) for x in (trials["node_a"] / "result.json").read_text().splitlines() if x.strip()]
    assert (trials["node_a"] / "error.txt").is_file(), (  # it failed once with its node...
        f"the node was lost after the trial ended: {done_before_kill}\n{output[-3000:]}")
    # ... and Tune restored it from its last checkpoint (not from scratch) in a new process, then it finished
    assert sorted({r["training_iteration"] for r in rows_a}) == list(range(1, ITERATIONS + 1))
    assert len({r["pid"] for r in rows_a}) == 2
    assert any(r["iterations_since_restore"] == 1 and r["training_iteration"] > 1 for r in rows_a), rows_a
    assert rows[trials["node_a"].name]["iterations"] == str(ITERATIONS)
