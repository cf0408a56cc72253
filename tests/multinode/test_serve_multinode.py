"""``arpo serve`` on a three-node cluster: two replicas on the two worker nodes (the proxy on the head only), a
replica placement the cluster cannot hold refused before Serve starts, and a worker node killed under load: every
client request ends with an answer or 503 + Retry-After, never a 500 or a hang, and the lost replica comes back when
a node offering its resources joins."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from tests.multinode.cluster import free_ports

START_TIMEOUT_S = 300
#: A request that takes longer than this is a hang (an answer of the tiny model takes well under a second).
REQUEST_TIMEOUT_S = 60
#: Requests a client sends, honouring Retry-After, before the recovered deployment must answer steadily.
RECOVERY_TRIES = 200
REPLICA = "ServeReplica:arpo:arpo_agents"


def serve_cmd(cluster, model_dir, port: int, resources: str) -> list[str]:
    return [sys.executable, "-m", "arpo_algo.cli", "serve", f"tiny={model_dir}", "--port", str(port),
            "--replicas", "2", "--replica-resources", resources, "--max-replicas-per-node", "1", "--max-tokens", "8",
            "--ready-timeout", str(START_TIMEOUT_S)]


def replica_nodes(cluster) -> list[dict]:
    """The custom resources of the node of every live replica, read by a short-lived driver from the GCS."""
    code = ("import json, ray, ray._private.state as st; ray.init(log_to_driver=False)\n"
            "nodes = {n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}\n"
            f"out = [nodes.get(a['Address']['NodeID'], {{}}) for a in st.actors().values() if a['State'] == 'ALIVE'"
            f" and '{REPLICA}' in a['ActorClassName']]\n"
            "print('REP' + json.dumps(out))\n"
            "print('ALL' + json.dumps([(a['ActorClassName'], a['State']) for a in st.actors().values()]))")
    r = subprocess.run([sys.executable, "-c", code], env=cluster.env(), capture_output=True, text=True, timeout=120)
    line = next((x for x in r.stdout.splitlines() if x.startswith("REP")), None)
    assert line is not None, r.stderr[-3000:]
    print(next(x for x in r.stdout.splitlines() if x.startswith("ALL")))
    return [{k: v for k, v in n.items() if k in ("node_a", "node_b", "head")} for n in json.loads(line[3:])]


def chat(port: int) -> tuple[int, str | None, str]:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "1+1?"}], "max_tokens": 8}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, None, ""
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After"), e.read().decode(errors="replace")[:300]


def test_replicas_the_cluster_cannot_place_are_refused(cluster, tiny_model_dir):
    [port] = free_ports(1)
    r = subprocess.run(serve_cmd(cluster, tiny_model_dir, port, '{"node_c": 1}'), env=cluster.env(),
                       capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "node_c = 2 (the Ray cluster has 0)" in r.stderr and "--replica-resources" in r.stderr
    assert "Traceback" not in r.stderr and "serving" not in r.stdout


def test_two_replicas_on_two_nodes_survive_a_lost_node(cluster, tiny_model_dir):
    [port] = free_ports(1)
    proc = subprocess.Popen(serve_cmd(cluster, tiny_model_dir, port, '{"worker": 1}'), env=cluster.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    statuses: list[tuple[int, str | None, str]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            statuses.append(chat(port))

    try:
        line = ""
        while proc.poll() is None and not line.startswith("serving"):
            line = proc.stdout.readline()
        assert line.startswith("serving"), proc.stdout.read()[-5000:]
        where = replica_nodes(cluster)
        assert sorted(n for w in where for n in w) == ["node_a", "node_b"], where  # one per worker, none on the head
        clients = [threading.Thread(target=client) for _ in range(2)]
        for c in clients:
            c.start()
        while len(statuses) < 4:
            time.sleep(0.05)
        cluster.nodes["a"].kill()
        seen = len(statuses)
        while len(statuses) < seen + 20:  # requests sent while the node's loss is noticed, and after
            time.sleep(0.05)
        cluster.add_worker("a2", 2, {"node_a": 1.0, "worker": 2.0})
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and len(where := replica_nodes(cluster)) < 2:
            time.sleep(1.0)
        stop.set()
        for c in clients:
            c.join(timeout=REQUEST_TIMEOUT_S + 5)
        assert not any(c.is_alive() for c in clients)  # no request hung
        assert sorted(n for w in where for n in w) == ["node_a", "node_b"], where  # the replica is back
        print("statuses:", [c for c, _, _ in statuses])
        codes = {code for code, _, _ in statuses}
        assert codes <= {200, 500, 503}, statuses
        assert all(retry for code, retry, _ in statuses if code == 503), statuses  # the replica's liveness answer
        # Known gap: a request in flight on the lost replica gets Ray Serve's proxy's plain 500 (the application
        # never sees it). Each client has one request in flight, and the router drops a replica on its first
        # failure, so no more than one per client.
        lost = [body for code, _, body in statuses if code == 500]
        assert len(lost) <= len(clients) and all(b == "Internal Server Error" for b in lost), statuses
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
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
