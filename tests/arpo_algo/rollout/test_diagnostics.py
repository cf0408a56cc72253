"""The diag/ metrics on a hand-built iteration: each name carries the value its definition says."""

from __future__ import annotations

import pytest

from arpo_algo.rollout import diagnostics as D
from arpo_algo.rollout.types import Group, Trajectory


def _t(tid, ids, mask, reward, kind="initial", parent=None, bp=None, ent=0.5):
    return Trajectory(
        tid, ids, mask, [0.0] * len(ids), [ent] * len(ids), reward=reward, kind=kind, parent=parent, branch_point=bp
    )


def test_group_diagnostics_by_hand():
    root = _t(0, [1, 2, 9, 9, 3, 4, 9, 5], [1, 1, 0, 0, 1, 1, 0, 1], 1.0)
    g0 = Group(
        0,
        [7],
        [
            root,
            _t(1, [1, 2, 9, 9, 6], [1, 1, 0, 0, 1], 0.0, "branch", 0, 4),  # after the 1st result
            _t(2, [1, 2, 9, 9, 3, 4, 9, 8], [1, 1, 0, 0, 1, 1, 0, 1], 0.0, "branch", 0, 7),  # 2nd
            _t(3, [1, 2], [1, 1], 1.0, "fillup"),
        ],
        task={"level": 3},
    )
    g1 = Group(1, [7], [_t(0, [1], [1], 0.0, ent=2.0), _t(1, [1], [1], 0.0, ent=2.0)], task={"level": 1})
    d = D.group_diagnostics([g0, g1])
    assert d[D.ZERO_VARIANCE_GROUP_FRAC] == 0.5
    assert d[D.DISTINCT_TRAJECTORIES] == (4 + 1) / 2
    assert d[D.BRANCHES_PER_GROUP] == 1.0 and d[D.FILLUPS_PER_GROUP] == 0.5
    assert d[D.BRANCHES_AFTER_CALL.format(1)] == 0.5 and d[D.BRANCHES_AFTER_CALL.format(2)] == 0.5
    assert d["diag/reward_level3"] == 0.5 and d["diag/reward_level1"] == 0.0
    trained = sum(sum(t.trained_mask) for t in g0.trajectories)
    assert d[D.ROLLOUT_ENTROPY] == pytest.approx((0.5 * trained + 2.0 * 2) / (trained + 2))
    assert d[D.REWARD_SD_IN_GROUP] == pytest.approx(0.25)
    assert D.group_diagnostics([]) == {}
