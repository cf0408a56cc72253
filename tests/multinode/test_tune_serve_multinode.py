"""``arpo tune`` and ``arpo serve`` on one three-node cluster (one cluster for the module: the two share its start).

Tune: two trials, each one's own process pinned to a different worker node by a grid over
``backend.main_resources``, a placement the cluster cannot hold refused before any trial starts, and the node that
runs a trial's process lost mid-trial: Tune restores that trial (``max_failures``) from its checkpoint in a new
process on a replacement node offering the same resource, while the trial on the other node runs through untouched.

Serve: two replicas on the two worker nodes (the proxy on the head only), a replica placement the cluster cannot hold
refused before Serve starts, and a worker node killed under load: every client request ends (none hangs) with an
answer or an OpenAI-shaped 503 + Retry-After (a request in flight on the lost replica too, never a 500); the lost
replica comes back when a node offering its resources joins."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from arpo_algo.run.local_cluster import free_ports
from tests.multinode.background import Background

RUN_TIMEOUT_S = 420
#: Enough iterations after the first result that the node is lost while its trial still runs.
ITERATIONS = 8


def kill_node_offering(cluster, resource: str):
    """Kill the live worker node that offers ``resource`` (an earlier test may have replaced the first one)."""
    [node] = [n for n in cluster.nodes.values() if n.alive and resource in n.resources]
    node.kill()
    return node


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
experiment = "{tmp_path / "base.toml"}"
search = "grid"
scheduler = "none"
iterations = {ITERATIONS}
max_concurrent = 2
max_failures = {max_failures}

[space]
"backend.main_resources" = {{grid = {placements}}}
""")
    return str(p)


def arpo(cluster, *args: str, log=None):
    """Run ``arpo ARGS`` on the cluster to its end, or beside the test with its output in ``log``."""
    cmd = [sys.executable, "-m", "arpo_algo.cli", *args]
    if log is not None:
        return Background(cmd, cluster.env(), log)
    return subprocess.run(cmd, env=cluster.env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def trials_by_node(out) -> dict[str, object]:
    """Trial folder per pinned resource, read from each trial's own params.json.

    Tune writes these files while the test polls them: a file not yet complete is read again on the next poll.
    """
    found = {}
    for params in (out / "arpo").glob("arpo_*/params.json"):
        try:
            [resource] = json.loads(params.read_text())["backend.main_resources"]
        except json.JSONDecodeError:
            continue
        found[resource] = params.parent
    return found


def iterations(trial_dir) -> list[int]:
    path = trial_dir / "result.json"
    text = path.read_text() if path.is_file() else ""
    rows = text.split("\n")[:-1]  # a last line without its newline is still being written
    return [json.loads(x)["training_iteration"] for x in rows if x.strip()]


def test_trial_placement_the_cluster_cannot_satisfy_is_refused(cluster, tiny_model_dir, tmp_path):
    sweep = write_sweep(tmp_path, tiny_model_dir, "[{node_a = 1}, {node_c = 1}]")
    r = arpo(cluster, "tune", sweep, "--output", str(tmp_path / "out"))
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "node_c = 1 (the Ray cluster has 0)" in r.stderr and "node_a" in r.stderr  # missing, and what exists
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "arpo").exists()  # refused before any trial


def test_tune_trials_on_two_nodes_and_one_restored_after_its_node_is_lost(cluster, tiny_model_dir, tmp_path):
    sweep = write_sweep(tmp_path, tiny_model_dir, "[{node_a = 1}, {node_b = 1}]")
    out = tmp_path / "out"
    run = arpo(cluster, "tune", sweep, "--output", str(out), log=tmp_path / "tune.log")
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        trial_a = None
        while run.running() and time.monotonic() < deadline:
            trial_a = trials_by_node(out).get("node_a") if (out / "arpo").is_dir() else None
            # two results, not one: the checkpoint Tune saves after a result is only known to the controller once
            # the trial's actor has run that save, which it does before the next iteration's result
            if trial_a is not None and len(iterations(trial_a)) >= 2:
                break
            time.sleep(0.2)
        assert trial_a is not None and len(iterations(trial_a)) >= 2, (
            f"no second result from the node_a trial ({'exited' if not run.running() else 'in time'})\n"
            f"{run.output()[-5000:]}"
        )
        done_before_kill = iterations(trial_a)
        # the trial's own process (the Algorithm and its learner) runs on the node offering node_a: it dies with it
        [node_a] = [n for n in cluster.nodes.values() if n.alive and "node_a" in n.resources]
        first_pid = json.loads((trial_a / "result.json").read_text().splitlines()[0])["pid"]
        assert first_pid in {p.pid for p in node_a.family()}, "the node_a trial's process is not on the node_a node"
        lost = kill_node_offering(cluster, "node_a")
        # a replacement offering the same resources joins, as a cluster manager would bring one up
        cluster.add_worker(lost.name + "2", lost.num_cpus, lost.resources)
        output = run.finish(RUN_TIMEOUT_S, "the sweep after its node was lost")
    finally:
        run.stop()
    assert run.proc.returncode == 0, output[-6000:]
    trials = trials_by_node(out)
    assert set(trials) == {"node_a", "node_b"}  # one trial pinned to each worker node
    rows = {r["trial"]: r for r in csv.DictReader((out / "results.csv").open())}
    assert all(rows[t.name]["status"] == "done" for t in trials.values()), rows
    assert iterations(trials["node_b"]) == list(range(1, ITERATIONS + 1))
    assert not (trials["node_b"] / "error.txt").exists()  # the other node's trial ran through untouched
    rows_a = [json.loads(x) for x in (trials["node_a"] / "result.json").read_text().splitlines() if x.strip()]
    assert (trials["node_a"] / "error.txt").is_file(), (  # it failed once with its node...
        f"the node was lost after the trial ended: {done_before_kill}\n{output[-3000:]}"
    )
    # ... and Tune restored it from its last checkpoint (not from scratch) in a new process, then it finished
    assert sorted({r["training_iteration"] for r in rows_a}) == list(range(1, ITERATIONS + 1))
    assert len({r["pid"] for r in rows_a}) == 2
    assert any(r["iterations_since_restore"] == 1 and r["training_iteration"] > 1 for r in rows_a), (
        done_before_kill,
        [(r["training_iteration"], r["iterations_since_restore"], r["pid"]) for r in rows_a],
    )
    assert rows[trials["node_a"].name]["iterations"] == str(ITERATIONS)


# ---------------------------------------------------------------------------------------------------------- serve

START_TIMEOUT_S = 300
#: A request that takes longer than this is a hang (an answer of the tiny model takes well under a second).
REQUEST_TIMEOUT_S = 60
#: Requests a client sends, honouring Retry-After, before the recovered deployment must answer steadily.
RECOVERY_TRIES = 200
REPLICA = "ServeReplica:arpo:arpo_agents"


def serve_cmd(cluster, model_dir, port: int, resources: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "arpo_algo.cli",
        "serve",
        f"tiny={model_dir}",
        "--port",
        str(port),
        "--replicas",
        "2",
        "--replica-resources",
        resources,
        "--max-replicas-per-node",
        "1",
        "--max-tokens",
        "8",
        "--ready-timeout",
        str(START_TIMEOUT_S),
        "--admin-key",  # live changes on: the owner's mailbox exists (its placement is checked)
        "admin-key-0123456789",
        "--admin-root",
        str(model_dir),
    ]


def actor_nodes(cluster, class_name: str) -> list[dict]:
    """The custom resources of the node of every live actor whose class name holds ``class_name``, read by a
    short-lived driver from the GCS."""
    code = (
        "import json, ray, ray._private.state as st; ray.init(log_to_driver=False)\n"
        "nodes = {n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}\n"
        f"out = [nodes.get(a['Address']['NodeID'], {{}}) for a in st.actors().values() if a['State'] == 'ALIVE'"
        f" and '{class_name}' in a['ActorClassName']]\n"
        "print('REP' + json.dumps(out))"
    )
    r = subprocess.run([sys.executable, "-c", code], env=cluster.env(), capture_output=True, text=True, timeout=120)
    line = next((x for x in r.stdout.splitlines() if x.startswith("REP")), None)
    assert line is not None, r.stderr[-3000:]
    return [{k: v for k, v in n.items() if k in ("node_a", "node_b", "head")} for n in json.loads(line[3:])]


def chat(port: int) -> tuple[int, str | None, str]:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "1+1?"}], "max_tokens": 8}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, None, ""
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After"), e.read().decode(errors="replace")[:300]
    except OSError as e:  # no answer at all (reset, refused, timed out): status 0, so the client keeps counting
        return 0, None, repr(e)


def wait_for_statuses(statuses: list, n: int) -> None:
    """Until the clients have ``n`` answers; every request ends within REQUEST_TIMEOUT_S, so this is bounded."""
    deadline = time.monotonic() + 2 * REQUEST_TIMEOUT_S + 0.05 * n
    while len(statuses) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(statuses) >= n, f"{len(statuses)} of {n} answers in time: {statuses[-5:]}"


def test_replicas_the_cluster_cannot_place_are_refused(cluster, tiny_model_dir):
    [port] = free_ports(1)
    r = subprocess.run(
        serve_cmd(cluster, tiny_model_dir, port, '{"node_c": 1}'),
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "node_c = 2 (the Ray cluster has 0)" in r.stderr and "--replica-resources" in r.stderr
    assert "Traceback" not in r.stderr and "serving" not in r.stdout


def test_serve_two_replicas_on_two_nodes_survive_a_lost_node(cluster, tiny_model_dir, tmp_path):
    [port] = free_ports(1)
    served = Background(
        serve_cmd(cluster, tiny_model_dir, port, '{"worker": 1}'), cluster.env(), tmp_path / "serve.log"
    )
    statuses: list[tuple[int, str | None, str]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            statuses.append(chat(port))

    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (
            served.running()
            and time.monotonic() < deadline
            and not any(x.startswith("serving") for x in served.output().splitlines())
        ):
            time.sleep(0.5)
        assert any(x.startswith("serving") for x in served.output().splitlines()), (
            f"not serving ({'exited' if not served.running() else 'in time'})\n{served.output()[-5000:]}"
        )
        where = actor_nodes(cluster, REPLICA)
        assert sorted(n for w in where for n in w) == ["node_a", "node_b"], where  # one per worker, none on the head
        # the agents' mailbox lives beside its owner (arpo serve, on the head): losing a worker cannot take it
        assert actor_nodes(cluster, "Mailbox") == [{"head": 1.0}]
        clients = [threading.Thread(target=client) for _ in range(2)]
        for c in clients:
            c.start()
        wait_for_statuses(statuses, 4)
        lost = kill_node_offering(cluster, "node_a")
        wait_for_statuses(statuses, len(statuses) + 20)  # requests sent while the node's loss is noticed, and after
        cluster.add_worker(lost.name + "2", lost.num_cpus, lost.resources)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and len(where := actor_nodes(cluster, REPLICA)) < 2:
            time.sleep(1.0)
        stop.set()
        for c in clients:
            c.join(timeout=REQUEST_TIMEOUT_S + 5)
        assert not any(c.is_alive() for c in clients)  # no request hung
        assert sorted(n for w in where for n in w) == ["node_a", "node_b"], where  # the replica is back
        print("statuses:", [c for c, _, _ in statuses])
        # every request ends with an answer or an OpenAI-shaped 503 + Retry-After: the replica's own (loading,
        # overloaded) or, for a request in flight on the lost replica, the proxy's (serve.proxy), never a 500
        assert {code for code, _, _ in statuses} <= {200, 503}, statuses
        refused = [(retry, json.loads(body)["error"]) for code, retry, body in statuses if code == 503]
        assert all(retry and e["type"] == "server_error" for retry, e in refused), statuses
        # each client has one request in flight, and the router drops a replica on its first failure
        print("503 codes:", sorted(e["code"] for _, e in refused))
        assert sum(e["code"] == "replica_lost" for _, e in refused) <= len(clients), statuses
        assert statuses.count((200, None, "")) > len(statuses) // 2
        # the new replica answers 503 + Retry-After until its agents are loaded; a client that honours Retry-After
        # then gets answers only (bounded: RECOVERY_TRIES requests)
        streak = tries = 0
        while streak < 8 and tries < RECOVERY_TRIES:
            code, retry, _ = chat(port)
            tries += 1
            streak = streak + 1 if code == 200 else 0
            if code == 503:
                time.sleep(float(retry))
        assert streak == 8, f"no steady answers after {tries} requests (last: {code})"
    finally:
        stop.set()
        served.proc.terminate()
        try:
            served.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            served.stop()
