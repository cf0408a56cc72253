"""benchmarks.bench_learner_backends end to end on the tiny model: every backend steps and is measured per rank.

Slow (four backends are started one after another, about a minute and a half); needs the deepspeed extra."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import bench_learner_backends


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")
def test_every_backend_steps_and_each_rank_reports_its_peak(tiny_model_dir, tmp_path, capsys):
    import ray

    if ray.is_initialized():  # the benchmark starts its own two-CPU Ray
        ray.shutdown()
    out = bench_learner_backends.main(
        ["--model", str(tiny_model_dir), "--groups", "2", "--steps", "1", "--out", str(tmp_path / "r.json")]
    )
    assert json.loads((tmp_path / "r.json").read_text()) == out
    assert list(out["backends"]) == ["local", "ddp", "zero2", "zero3"] and "CPUs" in out["machine"]
    for name, row in out["backends"].items():
        assert len(row["step_s"]) == 1 and row["step_s"][0] > 0
        assert len(row["peak_mib"]) == (1 if name == "local" else 2) and min(row["peak_mib"]) > 100
    assert out["backends"]["local"]["ratio"] == 1.0
    assert "zero3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_learner_backends.main(["--backends", "local,zero1"])
