"""`arpo tune` with Ray: a 2-trial x 2-iteration sweep on a tiny model (reports agree with the trials' own results,
best.toml trains with `arpo train`), and an interrupted sweep resumed without rerunning its finished trial."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arpo_algo.cli.main import main
from tests.arpo_algo.run.test_sweep import write_sweep

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def no_ray_after():
    yield
    import ray

    ray.shutdown()


def _trial_results(trial_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (trial_dir / "result.json").read_text().splitlines() if x.strip()]


def test_two_trial_sweep_reports_and_best_toml(tmp_path, tiny_model_dir, capsys, no_ray_after):
    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        'metric = "evaluation/accuracy"\nnum_samples = 2\niterations = 2\nscheduler = "none"\nseed = 3',
        '"tree.tau" = {uniform = [0.1, 1.0]}\n"training.lr" = {loguniform = [1e-5, 1e-3]}',
    )
    out = tmp_path / "sweep_out"
    assert main(["tune", path, "--output", str(out)]) == 0
    console = capsys.readouterr().out
    assert console.count("[tune] arpo trial ") == 2
    for name in (
        "results.csv",
        "results.md",
        "summary.md",
        "summary.json",
        "best.toml",
        "metric_vs_knobs.png",
        "metric_vs_iteration.png",
    ):
        assert (out / name).is_file(), name
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 2
    for row in rows:  # every row agrees with the trial's own result.json and params.json
        trial = out / "arpo" / row["trial"]
        results = _trial_results(trial)
        params = json.loads((trial / "params.json").read_text())
        assert len(results) == int(row["iterations"]) == 2 and row["status"] == "done"
        last = results[-1]
        assert float(row["evaluation/accuracy"]) == pytest.approx(last["evaluation"]["accuracy"])
        assert float(row["tool_calls"]) == pytest.approx(last["evaluation"]["tool_calls_per_traj"])
        assert float(row["tokens"]) == pytest.approx(sum(r["tokens_sampled"] for r in results))
        assert float(row["tree.tau"]) == pytest.approx(params["tree.tau"])
        assert float(row["training.lr"]) == pytest.approx(params["training.lr"])
        assert 0.1 <= params["tree.tau"] <= 1.0 and 1e-5 <= params["training.lr"] <= 1e-3  # the dotted names
        assert row["trial"] in (out / "results.md").read_text()
        assert len(row["trial"]) < 24  # short trial folder names
        assert any(p.name.startswith("checkpoint_") for p in trial.iterdir())
        assert any(p.name.startswith("events.out.tfevents") for p in trial.iterdir())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trials"] == 2 and summary["best"]["trial"] == rows[0]["trial"]
    best = (out / "best.toml").read_text()
    assert f"tau = {float(rows[0]['tree.tau']):.6}"[:12] in best
    # best.toml is a complete experiment: `arpo train` runs it unchanged.
    assert main(["train", str(out / "best.toml"), "--output", str(tmp_path / "best_run"), "--no-progress"]) == 0
    record = json.loads((tmp_path / "best_run" / "config.json").read_text())
    assert record["settings"]["tree"]["tau"] == pytest.approx(float(rows[0]["tree.tau"]))
    assert json.loads((tmp_path / "best_run" / "result.json").read_text())["iterations"] == 2


def test_seed_grid_evaluated_only_at_the_end(tmp_path, tiny_model_dir, no_ray_after):
    # search = "grid" with scheduler = "none": Tune gets no metric (iteration 1 has no held-out result), the report
    # ranks the trials by their last iteration's evaluation.
    # max_concurrent = 1 holds for a grid too: the second trial starts after the first has ended.
    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        'metric = "evaluation/accuracy"\nsearch = "grid"\nscheduler = "none"\niterations = 2\nmax_concurrent = 1',
        '"experiment.seed" = {grid = [0, 1]}',
    )
    out = tmp_path / "grid_out"
    assert main(["tune", path, "--output", str(out), "--set", "evaluation.every=2"]) == 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 2 and {r["status"] for r in rows} == {"done"}
    spans = []
    for row in rows:
        results = _trial_results(out / "arpo" / row["trial"])
        assert "evaluation" not in results[0] and len(results) == 2
        assert float(row["evaluation/accuracy"]) == pytest.approx(results[-1]["evaluation"]["accuracy"])
        spans.append((results[0]["timestamp"] - results[0]["time_this_iter_s"], results[-1]["timestamp"]))
    (_, first_end), (second_start, _) = sorted(spans)
    assert second_start >= first_end - 1, spans  # timestamps are whole seconds
    assert json.loads((out / "summary.json").read_text())["trials"] == 2


def test_interrupted_sweep_resumes_without_rerunning(tmp_path, tiny_model_dir):
    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        'num_samples = 2\niterations = 2\nmax_concurrent = 1\nscheduler = "none"\nsearch = "random"',
        '"tree.tau" = {uniform = [0.1, 1.0]}',
    )
    out = tmp_path / "sweep_out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "arpo_algo.cli", "tune", path, "--output", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "[tune] arpo trial 1/2" in line:
                proc.send_signal(signal.SIGINT)  # Ctrl-C after the first trial finished
                break
        rest, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines.append(rest)
    text = "".join(lines)
    assert "[tune] arpo trial 1/2" in text, text[-3000:]
    # The second trial may finish while the interrupt propagates (a tiny model trains fast); either way a resume
    # must rerun nothing that finished and complete the rest.
    finished = [
        d
        for d in (out / "arpo").iterdir()
        if d.is_dir() and len(_trial_results(d) if (d / "result.json").exists() else []) == 2
    ]
    assert 1 <= len(finished) <= 2, text[-3000:]
    if len(finished) == 1:
        assert "trial 2/2" not in text and "interrupted with 1 unfinished" in text, text[-3000:]
        assert not (out / "results.csv").exists()
    report = subprocess.run([*cmd, "--report"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
    rows = list(csv.DictReader((out / "results.csv").open()))  # the trials Tune recorded as finished
    done = {r["trial"] for r in rows}
    assert 1 <= len(done) and done <= {d.name for d in finished}
    finished = [d for d in finished if d.name in done]
    before = {d.name: ((d / "result.json").read_bytes(), (d / "result.json").stat().st_mtime) for d in finished}
    # Tune's state is pickles: a folder another user could have written is not restored (nothing of it unpickled)
    pickle_file = next((out / "arpo").rglob("*.pkl"))
    mode = pickle_file.stat().st_mode
    pickle_file.chmod(mode | 0o002)
    refused = subprocess.run([*cmd, "--resume"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "writable by other users" in refused.stderr, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    pickle_file.chmod(mode)
    time.sleep(1)
    resumed = subprocess.run([*cmd, "--resume"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert resumed.stdout.count("[tune] arpo trial ") == 2 - len(finished)  # only unfinished trials ran
    for d in finished:
        assert ((d / "result.json").read_bytes(), (d / "result.json").stat().st_mtime) == before[d.name]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 2 and all(r["iterations"] == "2" and r["status"] == "done" for r in rows)


def test_same_failure_in_every_trial_stops_and_shows_it_once(tmp_path, tiny_model_dir, capsys, no_ray_after):
    # A held-out split that does not exist passes the config checks but fails in every trial's first evaluation.
    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        'num_samples = 4\niterations = 1\nmax_concurrent = 1\nscheduler = "none"\nsearch = "random"',
        '"tree.tau" = {uniform = [0.1, 1.0]}',
        base_extra="",
    )
    out = tmp_path / "sweep_out"
    assert main(["tune", path, "--output", str(out), "--set", 'evaluation.split="nosuch"']) == 2
    captured = capsys.readouterr()
    assert captured.out.count("FAILED") == 2  # stopped after the first two identical failures, not all four
    assert "failed the same way" in captured.err and "nosuch" in captured.err
    assert "Traceback" not in captured.err
