"""Every arpo command that starts Ray starts its own unless an address is given: a stale ``ray_current_cluster`` file
in Ray's temporary folder (here a private ``RAY_TMPDIR``, never the machine's shared one) is not joined, and
``arpo serve`` refuses a Serve instance it did not start."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEAD = "127.0.0.1:9"  # the discard port: nothing of Ray answers there

SCRIPT = f"""
import ray
from ray import serve
from arpo_algo.run.sweep_run import start_ray
from arpo_base.errors import ArpoError
from serve.cli.serve import refuse_foreign_serve

start_ray()  # what arpo tune does; the Algorithm and arpo serve call the same init_ray
try:  # ray.shutdown() ends the Ray this script started, and nothing else of the machine
    address = ray.get_runtime_context().gcs_address
    assert address != {DEAD!r}, address
    print("STARTED", address, flush=True)
    refuse_foreign_serve()  # a Ray of its own runs no Serve yet
    serve.start(http_options={{"host": "127.0.0.1", "port": 0}})
    try:
        refuse_foreign_serve()
    except ArpoError as e:
        print("REFUSED", e, flush=True)
    serve.shutdown()
finally:
    ray.shutdown()
"""


def test_a_stale_cluster_file_is_not_joined(tmp_path):
    short = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    try:
        (Path(short) / "ray").mkdir()
        (Path(short) / "ray" / "ray_current_cluster").write_text(DEAD)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=short, PYTHONPATH=str(REPO))
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240
        )
        assert "STARTED" in out.stdout, out.stderr[-3000:]
        assert "REFUSED" in out.stdout and "did not start" in out.stdout, out.stdout + out.stderr[-3000:]
        assert (Path(short) / "ray" / "ray_current_cluster").read_text() == DEAD  # the file is left as it was
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.parametrize("top", ["arpo_algo", "serve", "benchmarks", "studies", "examples"])
def test_every_ray_init_names_its_address(top):
    """Each ``ray.init(`` in the code passes ``address=`` (init_ray passes "local" when none was given)."""
    bare = []
    for path in (REPO / top).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "init"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "ray"
                and not any(k.arg == "address" for k in node.keywords)
            ):
                bare.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bare, f"ray.init without an address (use arpo_base.ray_start.init_ray): {bare}"
