"""benchmarks.rollout_schedule end to end on the tiny model: both schedules, alternating, the same trees."""

from __future__ import annotations

import json


def test_rollout_schedule_times_both_schedules_and_finds_the_same_trees(tiny_model_dir, tmp_path, capsys):
    from benchmarks import rollout_schedule

    out = tmp_path / "r.json"
    res = rollout_schedule.main(
        ["--model", str(tiny_model_dir), "--rounds", "2", "--prompts", "2", "--max-response-tokens", "16"]
        + ["--threads", "1", "--out", str(out)]
    )
    assert [(r["round"], r["schedule"]) for r in res["rows"]] == [
        (0, "rounds"),
        (0, "waves"),
        (1, "waves"),
        (1, "rounds"),
    ]
    assert res["same_trees"] and json.loads(out.read_text())["same_trees"]
    waves = [r for r in res["rows"] if r["schedule"] == "waves"]
    assert all(r["engine_calls"] == 1 and r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in waves)
    assert all(0 < r["tokens_per_forward"] <= 16 for r in res["rows"])  # at most the engine batch per forward
    assert "CPU flags" in capsys.readouterr().out
