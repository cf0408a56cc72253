"""studies/entropy_after_tools.py on a hand-built dump (claim F1: entropy rises right after tool results)."""

from __future__ import annotations

import json

from studies.entropy_after_tools import main, paper_rule_rises, windows


def test_windows_and_report(tmp_path):
    # sampled 1.0 1.0 | result | 3.0 2.0 | result | 4.0
    t = {
        "entropies": [1.0, 1.0, 0, 0, 3.0, 2.0, 0, 4.0],
        "trained_mask": [1, 1, 0, 0, 1, 1, 0, 1],
        "parent": None,
        "branch_point": None,
    }
    w = windows(t, 2, 0)
    assert paper_rule_rises(t, k=2) == [True, True]
    assert paper_rule_rises(dict(t, entropies=[5.0] * 8), k=2) == [False] * 2
    assert w == {-1: [1.0, 2.0], -2: [1.0, 3.0], 0: [3.0, 4.0], 1: [2.0]}
    branch = dict(t, parent=0, branch_point=4)  # inherited tokens (before 4) are the parent's: not counted again
    assert windows(branch, 2, 4) == {0: [3.0, 4.0], 1: [2.0], -1: [2.0], -2: [3.0]}
    dump = tmp_path / "trees.jsonl"
    dump.write_text(json.dumps({"metrics": {"step": 0}, "trajectories": [t, branch]}) + "\n")
    assert main([str(dump), "--window", "2", "--output", str(tmp_path / "f1")]) == 0
    res = json.loads((tmp_path / "f1" / "f1.json").read_text())
    assert res["first_turn_mean"] == 1.0 and res["offsets"]["0"]["n"] == 4
    assert abs(res["mean_10_after"] - (3.5 + 2.0) / 2) < 1e-9
