"""arpo_algo/eval/trees.py: what the one writer records for a tree, and what the reader trusts."""

from __future__ import annotations

import json

import pytest

from arpo_algo.eval.trees import INDEX, K, TreeReader, TreeWriter, token_advantages
from arpo_algo.rollout.types import Group, Trajectory, TreeNode
from arpo_algo.train.learner_config import LearnerConfig


def _decode(ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


def _branched() -> Group:
    """Trajectory 0 samples 12 tokens, gets a 3-token tool result and samples 2 more; trajectory 1 branches after the
    tool result and samples 3 tokens of its own."""
    pre, tool = list(range(12)), [20, 21, 22]
    a_resp, b_resp = pre + tool + [1, 2], pre + tool + [3, 4, 5]
    mask_a, mask_b = [1] * 12 + [0] * 3 + [1] * 2, [1] * 12 + [0] * 3 + [1] * 3
    ent_a = [0.1 * i for i in range(12)] + [0.0] * 3 + [2.0, 2.0]
    ent_b = ent_a[:15] + [3.0, 1.0, 2.0]
    a = Trajectory(
        0, a_resp, mask_a, [-0.1] * 17, ent_a, reward=1.0, node_ids=[0, 1], finish_reason="answer", policy_version=3
    )
    b = Trajectory(
        1,
        b_resp,
        mask_b,
        [float("nan")] + [-0.2] * 17,
        ent_b,
        reward=0.0,
        parent=0,
        branch_point=15,
        kind="branch",
        node_ids=[0, 2],
        finish_reason="tool_limit",
        policy_version=3,
    )
    nodes = [TreeNode(0, None, 0, 15, 0, 3), TreeNode(1, 0, 15, 17, 1, 3), TreeNode(2, 0, 15, 18, 1, 3)]
    decisions = [
        {
            "trajectory": 0,
            "at": 15,
            "h_init": 0.5,
            "h_now": 1.5,
            "penalty_l": 0,
            "rule": "reference",
            "alpha": 0.5,
            "beta": 0.2,
            "tau": 1.0,
            "draws": [0.3],
            "branches": 1,
        },
        {
            "trajectory": 1,
            "at": 18,
            "h_init": 0.5,
            "h_now": float("nan"),
            "penalty_l": 0,
            "rule": "reference",
            "alpha": 0.5,
            "beta": 0.2,
            "tau": 1.0,
            "draws": [0.9],
            "branches": 0,
        },
    ]
    return Group(4, [7, 8], [a, b], nodes=nodes, policy_version=3, decisions=decisions)


def _independent() -> Group:
    """Two independent samples: build_tree hangs them under an empty root node."""
    a = Trajectory(0, [1, 2], [1, 1], [-0.1] * 2, [0.5] * 2, reward=1.0, node_ids=[0, 1])
    b = Trajectory(1, [3], [1], [-0.1], [0.5], reward=0.0, node_ids=[0, 2])
    return Group(5, [7], [a, b], nodes=[TreeNode(0, None, 0, 0, 0), TreeNode(1, 0, 0, 2, 1), TreeNode(2, 0, 0, 1, 1)])


def test_turn_credit_records_node_values_and_turns(tmp_path):
    groups = [_branched(), _independent()]
    credit = token_advantages(groups, LearnerConfig(advantage="turn", norm_adv_by_std=False))
    assert TreeWriter(tmp_path, _decode).record(
        1, groups, [c.advantages for c in credit], None, [c.values for c in credit]
    )
    reader = TreeReader(tmp_path)
    reader.refresh()
    rec = reader.group(1, 0)
    # The branch after the tool result (position 15) is the only node with two children: value (1 + 0) / 2. The root
    # has that one child, so the shared first turn gets no credit and the two second turns get +-0.5.
    assert [(n["value"], n["turns"]) for n in rec["nodes"]] == [
        (0.5, [[0, 15, 0.5, 0.5, 0.0]]),
        (1.0, [[15, 17, 0.5, 1.0, 0.5]]),
        (0.0, [[15, 18, 0.5, 0.0, -0.5]]),
    ]
    assert rec["trajectories"][0]["turn_values"] == [[0, 0.5], [15, 0.5], [17, 1.0]]
    assert rec["trajectories"][1]["advantages"][15:] == [-0.5] * 3
    ind = reader.group(1, 1)  # independent samples: the empty root node holds the root's value and no turn
    assert [(n["value"], n["turns"]) for n in ind["nodes"]] == [
        (0.5, []),
        (1.0, [[0, 2, 0.5, 1.0, 0.5]]),
        (0.0, [[0, 1, 0.5, 0.0, -0.5]]),
    ]
    grpo = token_advantages(groups, LearnerConfig())
    assert TreeWriter(tmp_path / "g", _decode).record(1, groups, [c.advantages for c in grpo])
    plain = TreeReader(tmp_path / "g")
    plain.refresh()
    assert "value" not in plain.group(1, 0)["nodes"][0] and plain.group(1, 0)["trajectories"][0]["turn_values"] is None


def test_a_branch_point_records_its_entropy_jump_and_the_advantages(tmp_path):
    groups = [_branched(), _independent()]
    credit = token_advantages(groups, LearnerConfig(norm_adv_by_std=False))
    assert all(c.values is None for c in credit)  # grpo values no nodes
    assert TreeWriter(tmp_path, _decode).record(2, groups, [c.advantages for c in credit])
    reader = TreeReader(tmp_path)
    assert reader.refresh() == [2]
    rec = reader.group(2, 0)
    root = rec["nodes"][0]
    assert root["branch"]["children"] == [1, 2]
    assert abs(root["branch"]["entropy_before"] - sum(0.1 * i for i in range(12 - K, 12)) / K) < 1e-3
    assert root["branch"]["entropy_after"] == [2.0, 2.0]
    # the decision that made the branch sits on its node; every decision, one without a clone too, on the group
    assert [d["draws"] for d in root["branch"]["decisions"]] == [[0.3]]
    assert len(rec["decisions"]) == 2 and rec["decisions"][1]["h_now"] is None
    assert root["text"] == [["model", _decode(range(12))], ["tool", _decode([20, 21, 22])]]
    # group-relative advantages (rewards 1 and 0, mean 0.5): +0.5 and -0.5 on every token; the shared node holds both
    assert rec["nodes"][1]["advantage"] == 0.5 and rec["nodes"][2]["advantage"] == -0.5 and root["advantage"] == 0.0
    t1 = rec["trajectories"][1]
    assert t1["sampled_logprobs"][0] is None and t1["policy_version"] == 3 and t1["advantages"][-1] == -0.5
    s = reader.iterations[2]["groups"][0]
    assert (s["solved"], s["failed"], s["tool_limit"], s["branch_points"], s["leaves"]) == (1, 1, 1, 1, 2)
    # independent samples under the empty root: no branch point
    assert all("branch" not in n for n in reader.group(2, 1)["nodes"])
    assert reader.iterations[2]["groups"][1]["branch_points"] == 0


def test_the_cap_and_the_rerun_iteration(tmp_path):
    w = TreeWriter(tmp_path, _decode, max_groups=1, every=2)
    assert not w.record(1, [_branched()])  # not an n-th iteration
    assert w.record(2, [_independent(), _branched()])
    assert w.record(2, [_branched(), _independent()])  # re-run after a resume: the last line wins
    reader = TreeReader(tmp_path)
    assert reader.refresh() == [2, 2]
    row = reader.iterations[2]
    assert row["sampled_groups"] == 2 and len(row["groups"]) == 1 and reader.group(2, 0)["prompt_index"] == 4
    assert len((tmp_path / INDEX).read_text().splitlines()) == 2
    assert json.loads((tmp_path / "format.json").read_text())["version"] == 1


def test_index_lines_with_numbers_that_are_not_counts_are_skipped(tmp_path):
    """Bug: an index line whose iteration was not an integer raised out of the reader (the viewer answered 500), and
    group -1 returned the last group instead of none."""
    w = TreeWriter(tmp_path, _decode)
    assert w.record(2, [_branched(), _independent()])
    good = (tmp_path / INDEX).read_text()
    row = json.loads(good)
    bad = [
        {**row, "iteration": "2"},
        {**row, "iteration": None},
        {**row, "iteration": -1},
        {**row, "groups": [{**row["groups"][0], "offset": "0"}]},
        {**row, "chunk": 7},
    ]
    (tmp_path / INDEX).write_text("".join(json.dumps(b) + "\n" for b in bad) + good)
    reader = TreeReader(tmp_path)
    assert reader.refresh() == [2]  # only the well-formed line
    with pytest.raises(IndexError):
        reader.group(2, -1)
    assert all("branch" not in n for n in reader.group(2, 1)["nodes"])  # a valid index still reads its group
