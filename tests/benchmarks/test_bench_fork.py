"""bench_fork runs end to end on real sandboxes: a fork and a replay reach the same state at every depth, and the
memory rows count the sandboxes' processes."""

from __future__ import annotations

import os
import shutil

import pytest

from arpo_env.tools.interpreter import live_interpreters


def test_bench_fork_runs_and_agrees_with_the_replay(tmp_path):
    if shutil.which("bwrap") is None:
        if os.environ.get("ARPO_REQUIRE_BWRAP") == "1":
            pytest.fail("ARPO_REQUIRE_BWRAP=1 (CI) but bubblewrap is not installed")
        pytest.skip("bubblewrap (bwrap) is not installed on this machine")
    from benchmarks import bench_fork

    out = bench_fork.main(
        [
            "--depths",
            "1",
            "2",
            "--rounds",
            "1",
            "--live",
            "1",
            "2",
            "--array-mb",
            "1",
            "--out",
            str(tmp_path / "fork.json"),
        ]
    )
    assert set(out["depths"]) == {1, 2} and all(r["fork_ms"] > 0 and r["replay_ms"] > 0 for r in out["depths"].values())
    if os.geteuid() == 0:  # per-tree uids: the memory part reads their processes
        assert all(r["forked_mb"] > 0 and r["fresh_mb"] > 0 for r in out["memory"].values())
    assert (tmp_path / "fork.json").is_file() and live_interpreters() == 0
