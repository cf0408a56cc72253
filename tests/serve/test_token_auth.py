"""``serve deploy``/``serve status`` against a Ray cluster under Ray's token authentication, as the serving how-to
says: the cluster started with ``RAY_AUTH_MODE=token`` refuses a client without it, and takes one that sets it and
has the token. A real head node (``ray start --head --block``, its own ports and temp folder) in this test's process
group, stopped by its id."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from arpo_algo.run.local_cluster import free_ports

pytest.importorskip("ray.serve")
pytest.importorskip("ray.dashboard")

BIN = Path(sys.executable).parent


def _env(**auth: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(auth)
    return env


@pytest.fixture(scope="module")
def cluster():
    """A head node under token authentication: (dashboard URL, token, HTTP port for Serve)."""
    token = secrets.token_hex(16)
    gcs, dash, client, agent, agent_grpc, runtime_env, metrics, http = free_ports(8)
    temp = tempfile.mkdtemp(prefix="rtok", dir="/tmp")  # Ray's socket paths must stay short
    proc = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            f"--dashboard-port={dash}",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={runtime_env}",
            f"--metrics-export-port={metrics}",
            "--num-cpus=1",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: everything it starts is stopped with it
    )
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while True:
            req = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(req, timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""
                    pytest.fail(f"the head node did not start (exit {proc.poll()}):\n{out[-3000:]}")
                time.sleep(1)
        yield url, token, http
    finally:
        # The whole throwaway group at once (an orderly `ray start --block` shutdown takes half a minute).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        left = [p.pid for p in psutil.process_iter(["cmdline"]) if temp in " ".join(p.info["cmdline"] or [])]
        for pid in left:  # a process of this head node outside its group (none expected)
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"processes of the test's head node outside its process group: {left}"


def _serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "serve"), *args], env=env, capture_output=True, text=True, timeout=180)


def test_serve_deploy_and_status_need_the_token_mode_and_the_token(cluster, tmp_path):
    url, token, http = cluster
    config = tmp_path / "serve_config.yaml"
    config.write_text(f"http_options:\n  host: 127.0.0.1\n  port: {http}\napplications: []\n")
    without = _serve(["deploy", "--address", url, str(config)], _env())
    assert without.returncode != 0 and "Authentication required" in without.stdout + without.stderr, without
    wrong = _serve(["status", "--address", url], _env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32))
    assert wrong.returncode != 0 and "Authentication failed" in wrong.stdout + wrong.stderr, wrong
    auth = _env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    deployed = _serve(["deploy", "--address", url, str(config)], auth)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    status = _serve(["status", "--address", url], auth)
    assert status.returncode == 0 and "applications: {}" in status.stdout, status.stdout + status.stderr
