"""Process censuses hold with a zombie in the tree: a child that ended and was never reaped is counted as ended, and
the suite's own end-of-run check names a zombie's parent and fails the run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from arpo_base.procs import cmdline, descendants, is_alive, name, unreaped

REPO = Path(__file__).resolve().parents[2]


def _zombie_child() -> subprocess.Popen:
    """A direct child of this process that has ended and is not yet waited for."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child did not end"
        time.sleep(0.02)
    return proc


#: A parent that starts a child which ends at once, never waits for it, and sleeps: a zombie one level down.
NEGLECTFUL_PARENT = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def zombie():
    proc = _zombie_child()
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.wait()


def test_a_zombie_child_is_counted_as_ended_by_every_census(zombie):
    from tests.arpo_algo.rollout.test_vllm_lora import _started_processes
    from tests.serve.test_serve_vllm import _engine_cores

    assert zombie.pid not in [p.pid for p in descendants()]
    assert not is_alive(zombie)
    assert cmdline(zombie) is None and name(zombie)  # its name stays readable, its command line is gone
    assert zombie.pid not in [p.pid for p in _started_processes()]  # raised ZombieProcess before
    assert _engine_cores([zombie]) == []
    found = [z for z in unreaped() if z.pid == zombie.pid]
    assert len(found) == 1 and found[0].parent_pid == os.getpid(), found


def test_a_zombie_below_a_cluster_node_is_not_part_of_its_family():
    from arpo_algo.run.local_cluster import Node

    parent = subprocess.Popen(
        [sys.executable, "-c", NEGLECTFUL_PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 30
        while child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        node = Node("n", {}, 1, parent, Path(os.devnull))
        assert node.family() == []
        assert [(z.pid, z.parent_pid) for z in unreaped(parent.pid)] == [(child.pid, parent.pid)]
        node.kill()  # reaps the node; its zombie child goes with it
        assert not node.alive
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()


def test_a_vanished_process_has_no_descendants():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert descendants(proc.pid) == [] and unreaped(proc.pid) == []


def test_the_suite_fails_naming_the_parent_of_a_child_left_unreaped(tmp_path):
    (tmp_path / "conftest.py").write_text("pytest_plugins = ['tests.reaping']\n")
    (tmp_path / "test_case.py").write_text(
        "import subprocess, sys, time\n\n\n"
        "KEEP = []\n\n\n"
        "def test_leaves_a_zombie():\n"
        "    KEEP.append(subprocess.Popen([sys.executable, '-c', 'pass']))\n"
        "    time.sleep(1)\n\n\n"
        "def test_after():\n"
        "    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "ARPO_TEST_HARD_EXIT": "0"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_case.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1 and "2 passed" in out, out
    assert "left unreaped" in out and "child of pid " in out and "test_case.py::test_leaves_a_zombie" in out, out
    (tmp_path / "test_case.py").write_text(
        "import subprocess, sys\n\n\ndef test_waits():\n"
        "    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
    )
    clean = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_case.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert clean.returncode == 0 and "left unreaped" not in clean.stdout, clean.stdout + clean.stderr
