"""The test tiers a newcomer runs separately (-m unit / integration / gpu / vllm) follow the rule in conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLLECT = """
import json, sys, pytest
class Report:
    def pytest_collection_finish(self, session):
        names = ("unit", "integration", "multinode", "gpu", "vllm")
        tiers = {i.name: sorted(m.name for m in i.iter_markers() if m.name in names) for i in session.items}
        print("TIERS " + json.dumps(tiers))
pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "", *sys.argv[1:]], plugins=[Report()])
"""


def test_tiers_follow_the_rule():
    files = [
        "tests/arpo_algo/train/test_learner.py",
        "tests/arpo_algo/rollout/test_vllm_engine.py",
        "tests/arpo_algo/cli/test_cli.py",
        "tests/multinode/test_train_multinode.py",
    ]
    out = subprocess.run(
        [sys.executable, "-c", COLLECT, *files],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("TIERS "))
    tiers = json.loads(line[len("TIERS ") :])
    assert tiers["test_config_validation"] == ["unit"]  # no model, no Ray, no subprocess
    assert tiers["test_state_round_trip_is_bit_equal"] == ["integration"]  # loads the tiny model (a fixture)
    assert tiers["test_version"] == ["integration"]  # the CLI in a subprocess (an integration module)
    assert tiers["test_worker_node_lost_mid_iteration"] == ["multinode"]  # a cluster of several nodes
    gpu = {name for name, marks in tiers.items() if "gpu" in marks or "vllm" in marks}
    assert gpu and all("unit" not in tiers[n] and "integration" not in tiers[n] for n in gpu)
    assert all(len(set(m) & {"unit", "integration", "multinode"}) == 1 for n, m in tiers.items() if n not in gpu)
