"""A Ray cluster of several nodes on this machine, each node a ``ray start --block`` process in its own session.

Invariants the tier relies on:

* every address is 127.0.0.1 and every port is picked free, so the cluster never meets another Ray on this machine
  (a local ``ray.init()`` elsewhere cannot join it: its temp dir, which holds ``ray_current_cluster``, is private);
* a node is one ``ray start`` process and its descendants (raylet, agents, workers), so killing that tree is the
  loss of that node, and :meth:`LocalCluster.shutdown` leaves no process of the cluster behind;
* node death is detected within seconds (the GCS health check runs every ``HEALTH_PERIOD_MS``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

#: GCS health checks: a node that misses HEALTH_FAILURES checks HEALTH_PERIOD_MS apart is declared dead.
HEALTH_PERIOD_MS, HEALTH_FAILURES = 1000, 3
OBJECT_STORE_BYTES = 100 * 1024 * 1024
START_TIMEOUT_S = 120
#: ``ray start`` rewrites 127.0.0.1 (as a node address and in ``--address``) to the host's outward address; the
#: nodes run it with that rewrite disabled so every node, and the GCS, listen on loopback only.
RAY_START = (
    "import sys, ray._private.services as s\n"
    "s.resolve_ip_for_localhost = lambda host: host\n"
    "from ray.scripts.scripts import main\n"
    "sys.argv[0] = 'ray'\n"
    "main()\n"
)
#: A driver's switch for the same rewrite: off, ``RAY_ADDRESS=127.0.0.1:port`` stays on loopback. (A ``ray start``
#: of a worker node refuses to run with it off, hence RAY_START.)
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held open while picking, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Node:
    name: str
    resources: dict[str, float]
    num_cpus: int
    proc: subprocess.Popen
    log: Path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def family(self) -> list:
        """The node's living processes below ``ray start`` (raylet, agents, workers), as psutil processes."""
        from arpo_base.procs import descendants

        return descendants(self.proc.pid)

    def kill(self, known: list | None = None) -> None:
        """SIGKILL the whole node: ``ray start``, its raylet and agents (one process group) and every worker the
        raylet spawned (each worker runs in a process group of its own, so it is found as a descendant); ``known``
        adds processes found earlier (a graceful stop may have orphaned them)."""
        import psutil

        family = self.family() + list(known or [])
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)
        psutil.wait_procs(family, timeout=30)


@dataclass
class LocalCluster:
    """Head plus worker nodes on 127.0.0.1 (see the module docstring)."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="arpo-mn-")))
    nodes: dict[str, Node] = field(default_factory=dict)
    port: int = 0
    #: The cluster's own token (Ray's token authentication), never a file in the user's home.
    token: str = field(default_factory=lambda: secrets.token_hex(32))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def temp_dir(self) -> Path:
        return self.root / "ray"

    def env(self, node: bool = False) -> dict[str, str]:
        """The environment of a driver joining the cluster (``RAY_ADDRESS``), or of the nodes' processes."""
        repo = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
        return {
            **os.environ,
            "PYTHONPATH": path,
            "RAY_ADDRESS": self.address,
            "RAY_TMPDIR": str(self.root),
            "OMP_NUM_THREADS": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "GLOO_SOCKET_IFNAME": "lo",
            "RAY_DEDUP_LOGS": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            # Ray runs its workers at nice 15 by default; here they keep the driver's priority, so a timing of
            # actors against the driver compares like with like on a machine shared with other jobs
            **({"RAY_worker_niceness": "0"} if node else {LOOPBACK_ONLY: "0"}),
        }

    def _start(self, name: str, args: list[str], num_cpus: int, resources: dict[str, float]) -> Node:
        log = self.root / f"{name}.log"
        agent, agent_grpc, metrics, runtime_env, manager, objects = free_ports(6)
        cmd = [
            sys.executable,
            "-c",
            RAY_START,
            "start",
            "--block",
            "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps(resources)}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--temp-dir={self.temp_dir}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={runtime_env}",
            f"--node-manager-port={manager}",
            f"--object-manager-port={objects}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            *args,
        ]
        with log.open("w") as f:
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env(node=True), start_new_session=True
            )
        node = Node(name, resources, num_cpus, proc, log)
        self.nodes[name] = node
        return node

    def start_head(self, num_cpus: int = 1, resources: dict[str, float] | None = None) -> Node:
        self.root.mkdir(parents=True, exist_ok=True)
        self.port, client = free_ports(2)
        system = {
            "health_check_period_ms": HEALTH_PERIOD_MS,
            "health_check_failure_threshold": HEALTH_FAILURES,
            "health_check_timeout_ms": HEALTH_PERIOD_MS,
            "health_check_initial_delay_ms": 0,
        }
        return self._start(
            "head",
            [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--ray-client-server-port={client}",
                f"--system-config={json.dumps(system)}",
            ],
            num_cpus,
            resources or {"head": 1.0},
        )

    def start(self, workers: dict[str, dict[str, float]], worker_cpus: int) -> None:
        """Head, then each worker with its resources, one at a time (nodes starting together race for socket
        names); every process is stopped if any node fails to come up."""
        try:
            self.start_head()
            self.wait_for(["head"])
            for name, resources in workers.items():
                self.add_worker(name, worker_cpus, resources)
                self.wait_for([name])
        except BaseException:
            self.shutdown()
            raise

    def add_worker(self, name: str, num_cpus: int, resources: dict[str, float]) -> Node:
        return self._start(name, [f"--address={self.address}"], num_cpus, resources)

    def wait_for(self, names: list[str], timeout: float = START_TIMEOUT_S) -> None:
        """Until every named node's resources are in the cluster (a dead node's are gone within seconds)."""
        want = {k: v for n in names for k, v in self.nodes[n].resources.items()}
        deadline = time.monotonic() + timeout
        have: dict = {}
        while time.monotonic() < deadline:
            for n in names:
                if not self.nodes[n].alive:
                    raise RuntimeError(f"node {n} exited:\n{self.nodes[n].log.read_text()[-3000:]}")
            have = self.resources()
            if all(have.get(k, 0.0) >= v for k, v in want.items()):
                return
            time.sleep(1.0)
        raise TimeoutError(f"nodes {names} not up after {timeout}s; cluster has {have}")

    def resources(self) -> dict[str, float]:
        """``ray.cluster_resources()`` read by a short-lived driver (the test process never joins the cluster)."""
        code = (
            "import json, os, ray; ray.init(address=os.environ['RAY_ADDRESS'], log_to_driver=False); "
            "print('RES' + json.dumps(ray.cluster_resources()))"
        )
        out = subprocess.run([sys.executable, "-c", code], env=self.env(), capture_output=True, text=True, timeout=120)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RES")), None)
        if line is None:
            raise RuntimeError(f"cannot read the cluster's resources:\n{out.stderr[-3000:]}")
        return json.loads(line[3:])

    def shutdown(self) -> None:
        """Workers first, then the head; every process of every node is killed, whatever state it is in."""
        for node in sorted(self.nodes.values(), key=lambda n: n.name == "head"):
            known = node.family()
            if node.alive:
                try:
                    os.killpg(node.proc.pid, signal.SIGTERM)
                    node.proc.wait(timeout=5)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            node.kill(known)
        shutil.rmtree(self.root, ignore_errors=True)
