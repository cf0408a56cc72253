"""``arpo view`` on a sweep folder lists its trials and views the one named (trees written by the real writer, in the
layout Tune gives a sweep: ``<experiment>/<trial>/trees``)."""

from __future__ import annotations

from pathlib import Path

from arpo_algo.cli.main import main
from arpo_algo.eval.trees import TreeWriter
from arpo_algo.models import byte_tokenizer
from arpo_algo.rollout.types import Group, Trajectory, TreeNode


def _trial(folder: Path, iterations: int) -> None:
    tok = byte_tokenizer()
    resp = tok.encode("<answer>1</answer>", add_special_tokens=False)
    traj = Trajectory(0, resp, [1] * len(resp), [-0.5] * len(resp), [0.7] * len(resp), reward=1.0, node_ids=[0])
    group = Group(
        0, tok.encode("What is 1?", add_special_tokens=False), [traj], nodes=[TreeNode(0, None, 0, len(resp), 0, 0)]
    )
    writer = TreeWriter(folder / "trees", lambda x: tok.decode(x))
    for it in range(1, iterations + 1):
        writer.record(it, [group], [[[1.0] * len(resp)]])


def test_a_sweep_lists_its_trials_and_views_one(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    _trial(sweep / "arpo" / "arpo_aaaaa_00000", 2)
    _trial(sweep / "arpo" / "arpo_bbbbb_00001", 1)
    (sweep / "arpo" / "arpo_ccccc_00002").mkdir()  # a trial that recorded nothing is not listed

    assert main(["view", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "2 trials with rollout trees" in out
    assert "arpo_aaaaa_00000  iterations 1-2" in out and "arpo_bbbbb_00001  iterations 1-1" in out
    assert "arpo_ccccc" not in out and "--trial arpo_aaaaa_00000" in out

    html = tmp_path / "b.html"
    assert main(["view", str(sweep / "arpo"), "--trial", "arpo_bbbbb", "--export", str(html)]) == 0
    assert "iteration 1" in capsys.readouterr().out and html.is_file()

    assert main(["view", str(sweep), "--trial", "arpo_"]) == 2  # a prefix of both: named, not guessed
    assert "matches 2 of the sweep's trials" in capsys.readouterr().err
