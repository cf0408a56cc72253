"""The credit-share reader counts trained tokens and their advantages over groups with reward spread only."""

from __future__ import annotations

import json

import pytest

from studies.credit_share import main, run_share


def _traj(reward, mask, adv):
    return {"reward": reward, "trained_mask": mask, "advantages": adv}


def test_shares_count_trained_tokens_of_groups_with_spread(tmp_path, capsys):
    run = tmp_path / "cfg" / "seed_0"
    (run / "trees").mkdir(parents=True)
    spread = {"trajectories": [_traj(1.0, [1, 1, 0, 1], [0.5, 0.0, 9.0, -0.5]), _traj(0.0, [1, 1], [0.0, -1.0])]}
    flat = {"trajectories": [_traj(1.0, [1], [0.7]), _traj(1.0, [1], [0.7])]}  # no spread: no signal, not counted
    (run / "trees" / "iter_000001.jsonl").write_text(json.dumps(spread) + "\n" + json.dumps(flat) + "\n")
    r = run_share(run)
    # 5 trained tokens (the masked tool token's advantage is not counted), 3 of them nonzero, |adv| summing to 2
    assert r == {"groups_with_spread": 1, "trained_tokens": 5, "nonzero_share": 0.6, "mean_abs_advantage": 0.4}
    assert main(["--runs-under", str(tmp_path)]) == 0
    assert "| cfg | 1 | 0.600 | 0.400 |" in capsys.readouterr().out


def test_a_folder_without_trees_is_an_error_not_a_zero(tmp_path, capsys):
    with pytest.raises(FileNotFoundError):
        run_share(tmp_path)
    assert main([str(tmp_path)]) == 2
    assert "no recorded trees" in capsys.readouterr().err
