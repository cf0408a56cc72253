"""The multinode tier: one Ray cluster of three nodes on 127.0.0.1 per test module (arpo_algo/run/local_cluster.py)."""

from __future__ import annotations

import pytest

from arpo_algo.run.local_cluster import LocalCluster

#: Worker nodes: each offers its own resource (to pin one actor to it) and a shared "worker" pool.
WORKERS = {"a": {"node_a": 1.0, "worker": 2.0}, "b": {"node_b": 1.0, "worker": 2.0}}
WORKER_CPUS = 2


@pytest.fixture(scope="module")
def cluster():
    """Head (1 CPU, resource ``head``) and workers ``a``/``b``; every process stopped at the end, even on failure."""
    c = LocalCluster()
    c.start(WORKERS, WORKER_CPUS)
    try:
        yield c
    finally:
        c.shutdown()
