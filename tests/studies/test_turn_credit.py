"""The turn-credit bias study: every tree of a small stopping process enumerated exactly."""

from __future__ import annotations

import pytest

from studies.turn_credit import GO, STOP, bias_table, main, tree_count


def test_turn_credit_is_unbiased_where_the_per_turn_index_baseline_is_not():
    rows = {(r["k"], r["action"]): r for r in bias_table([0.5, 0.5, 1.0], [0.2, 0.5, 0.9], m=2)}
    assert set(rows) == {(0, STOP), (0, GO), (1, STOP), (1, GO), (2, STOP)}
    # exact: V2 = 0.9, V1 = 0.25 + 0.45 = 0.7, V0 = 0.1 + 0.35 = 0.45
    want = {(0, STOP): -0.25, (0, GO): 0.25, (1, STOP): -0.2, (1, GO): 0.2, (2, STOP): 0.0}
    for key, r in rows.items():
        assert r["exact"] == pytest.approx(want[key], abs=1e-12)
        assert r["turn"] == pytest.approx(r["exact"], abs=1e-9)  # unbiased, leave-one-out form
        assert r["turn (trained)"] == pytest.approx(r["exact"] / 2, abs=1e-9)  # (m - 1) / m of it, as trained
    # Both other baselines weight a subtree by how often it branched, which going on makes more likely.
    assert abs(rows[(0, GO)]["leaf mean"] - 0.25) > 0.01 and abs(rows[(0, GO)]["per-turn index"] - 0.25) > 0.01
    assert abs(rows[(1, GO)]["per-turn index"] - 0.2) > 0.02  # and the index mixes turns of different nodes


def test_enumeration_size_is_checked(capsys):
    assert tree_count(3, 2) == 1444
    with pytest.raises(ValueError, match="trees to enumerate"):
        bias_table([0.5, 0.5, 0.5, 1.0], [0.1] * 4, m=2)
    with pytest.raises(ValueError, match="last turn must stop"):
        bias_table([0.5, 0.5], [0.1, 0.2], m=2)
    main(["--p", "0.5", "1", "--q", "0.2", "0.9", "--m", "2"])
    out = capsys.readouterr().out
    assert "| 0 | go on | +0.3500 | +0.3500 |" in out
