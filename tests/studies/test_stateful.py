"""studies/stateful.py end to end at the smoke budget on the tiny model: one SFT checkpoint per arm, each trained on
its own form of the level-5 demonstrations, one RL run per arm and seed from its own checkpoint, the report with the
cost per solved task and the paired test; a second invocation reuses what finished and refuses other SFT settings."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from arpo_env.tools.interpreter import live_interpreters
from studies.stateful import ARMS, main


def test_the_study_wires_both_arms_end_to_end(tiny_model_dir, tmp_path, monkeypatch, capsys):
    if shutil.which("bwrap") is None and os.environ.get("ARPO_REQUIRE_BWRAP") != "1":
        pytest.skip("bubblewrap (bwrap) is not installed on this machine")
    monkeypatch.setenv("ARPO_SMOKE", "1")
    out = tmp_path / "stateful"
    # The byte-level tiny tokenizer needs room for a level-5 demonstration (its prompt alone is ~600 bytes).
    args = [
        "--model",
        str(tiny_model_dir),
        "--seeds",
        "0",
        "--output",
        str(out),
        "--no-progress",
        "--sft-set",
        "max_seq_len=2048",
        "--sft-set",
        "levels=[5]",
    ]
    assert main(args) == 0
    for arm, (_, persistent) in ARMS.items():
        sft = json.loads((out / f"sft_{arm}" / "sft_metrics.json").read_text())
        assert sft["config"]["persistent_python"] is persistent and sft["counts"]["kept"] > 0, sft["counts"]
        rerun = json.loads((out / arm / "seed_0" / "rerun.json").read_text())
        assert str(out / f"sft_{arm}") in rerun["command"]  # each arm from its own checkpoint
        assert rerun["sections"]["env"]["tools"]["python"]["persistent"] is persistent
    assert live_interpreters() == 0
    report = (out / "report.md").read_text()
    assert "| persistent | 1 |" in report and "| stateless | 1 |" in report
    assert "persistent minus stateless" in report and "Wilcoxon" in report
    extra = json.loads((out / "stateful.json").read_text())
    assert set(extra["cost_per_solved"]) == set(ARMS) and "persistent" in extra["test"]
    assert extra["interpreters"]["stateless"] == {"0": None}  # the stateless arm never starts an interpreter
    stamp = (out / "persistent" / "seed_0" / "metrics.jsonl").stat().st_mtime_ns
    assert main(args) == 0  # everything finished: reused, nothing trained again
    assert (out / "persistent" / "seed_0" / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert "SFT done earlier" in capsys.readouterr().out
    assert main([*args, "--sft-set", "epochs=2"]) == 2  # another SFT setting is refused, not mixed in
    assert "give this study its own --output" in capsys.readouterr().err


def test_cost_per_solved_task_is_the_held_out_totals_over_the_tasks_solved(tmp_path):
    """Calls and sampled tokens of the whole held-out run divided by the tasks it solved, at the first and the last
    evaluation; a run that solved nothing has no cost per solved task (None), not a division by zero."""
    from studies.stateful import per_solved

    def row(it, acc, calls, tokens):
        return {
            "iteration": it,
            "evaluation/accuracy": acc,
            "evaluation/num_trajectories": 32.0,
            "evaluation/tool_calls_per_traj": calls,
            "evaluation/tokens_sampled": tokens,
        }

    rows = [row(0, 0.0, 1.5, 4000.0), {"iteration": 1, "rollout/tool_calls": 9.0}, row(6, 0.25, 2.0, 3200.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = per_solved(str(tmp_path))
    assert got == {"calls_before": None, "tokens_before": None, "calls_after": 2.0 * 32 / 8, "tokens_after": 400.0}


def test_interpreter_figures_sum_forks_over_steps_and_keep_the_largest_peaks(tmp_path):
    from studies.stateful import interpreter_figures

    def step(it, forks, ms_total, failed, peak, pss):
        return {
            "iteration": it,
            "rollout/interpreter_forks": forks,
            "rollout/interpreter_fork_ms_total": ms_total,
            "rollout/interpreter_forks_failed": failed,
            "rollout/interpreters_peak": peak,
            "rollout/interpreter_pss_mib_peak": pss,
        }

    rows = [
        {"iteration": 0, "evaluation/accuracy": 0.0},
        step(1, 4.0, 40.0, 0.0, 6.0, 90.0),
        step(2, 0.0, 0.0, 1.0, 9.0, 70.0),
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert interpreter_figures(str(tmp_path)) == {
        "forks_per_step": 2.0,
        "fork_ms": 10.0,
        "forks_failed": 1.0,
        "interpreters_peak": 9.0,
        "pss_mib_peak": 90.0,
    }
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert interpreter_figures(str(tmp_path)) is None


def test_sft_settings_the_study_sets_itself_are_refused(tmp_path, capsys):
    for key in ("persistent_python=true", "model=other", "seed=3", "output_dir=/tmp/x"):
        assert main(["--output", str(tmp_path / "s"), "--sft-set", key]) == 2
        err = capsys.readouterr().err
        assert f"--sft-set {key.split('=')[0]} is set by the study itself" in err and "Traceback" not in err
    assert not (tmp_path / "s").exists()  # refused before anything was written
