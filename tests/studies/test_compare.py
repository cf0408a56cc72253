"""studies/compare.py on a tiny model: same seed, same machine, same result; --equal-budget names the field."""

from __future__ import annotations

import json

import pytest

from studies.compare import main, paired, stats
from tests.arpo_algo.run.test_train_cli import write_experiment

TIMING = ("time", "_s", "tokens_per_s", "timers/", "rollout/engine/")


def _strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING)}


def test_compare_is_deterministic_and_reports(tiny_model_dir, tmp_path, capsys):
    exp = write_experiment(tmp_path, tiny_model_dir, iterations=1)
    outs = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert (
            main(
                [
                    str(exp),
                    "--sft",
                    str(tiny_model_dir),
                    "--seeds",
                    "3",
                    "--output",
                    str(out),
                    "--eval-every",
                    "1",
                    "--no-progress",
                ]
            )
            == 0
        )
        outs.append(out)
    rows = [
        [_strip(json.loads(x)) for x in (o / "tiny" / "seed_3" / "metrics.jsonl").read_text().splitlines()]
        for o in outs
    ]
    assert rows[0] == rows[1] and len(rows[0]) == 2
    trees = [(o / "tiny" / "seed_3" / "trees" / "iter_000001.jsonl").read_text() for o in outs]
    assert trees[0] == trees[1] and trees[0]
    rerun = json.loads((outs[0] / "tiny" / "seed_3" / "rerun.json").read_text())
    assert "experiment.seed=3" in rerun["command"] and "model.path=" in rerun["command"]
    report = json.loads((outs[0] / "report.json").read_text())["summary"]["tiny"]
    assert report["seeds"] == [3] and report["before"]["n"] == 1 and report["tool_calls_total"] >= 0
    curve = [a for _, _, a in json.loads((outs[0] / "tiny" / "seed_3" / "compare_run.json").read_text())["curve"]]
    assert report["best"]["mean"] == max(curve) and report["drop_from_best"]["mean"] == max(curve) - curve[-1]
    assert "| tiny | 1 |" in (outs[0] / "report.md").read_text()
    # the optimizer steps the run realised, summed from its per-iteration metrics, are in the table
    raw = [json.loads(x) for x in (outs[0] / "tiny" / "seed_3" / "metrics.jsonl").read_text().splitlines()]
    assert any("learner/optimizer_steps" in r for r in raw)
    taken = sum(r.get("learner/optimizer_steps", 0.0) for r in raw)
    assert report["optimizer_steps"] == {"mean": taken, "min": taken, "max": taken}
    assert f"| {taken:.1f} ({taken:.0f} - {taken:.0f}) |" in (outs[0] / "report.md").read_text()


def test_equal_budget_refusal_names_the_field(tiny_model_dir, tmp_path, capsys):
    a = write_experiment(tmp_path, tiny_model_dir)
    b = tmp_path / "other.toml"
    b.write_text(a.read_text().replace("budget = 2", "budget = 3"))
    assert main([str(a), str(b), "--sft", str(tiny_model_dir), "--output", str(tmp_path / "o"), "--equal-budget"]) == 2
    err = capsys.readouterr().err
    assert "tree.budget" in err and "tiny: 2" in err and "other: 3" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("extra", "field", "shown"),
    [
        ("mini_batches = 2", "training.mini_batches", "other: 2"),
        ("ppo_epochs = 2", "training.ppo_epochs", "other: 2"),
        # AEPO's unset mini_batches resolves to min(8, prompts_per_step) = 2 against GRPO's 1
        ("", "training.mini_batches", "other: 2"),
    ],
)
def test_equal_budget_refuses_arms_that_take_different_optimizer_steps_per_batch(
    tiny_model_dir, tmp_path, capsys, extra, field, shown
):
    a = write_experiment(tmp_path, tiny_model_dir)
    a.write_text(a.read_text().replace("prompts_per_step = 1", "prompts_per_step = 2"))
    b = tmp_path / "other.toml"
    text = a.read_text().replace("prompts_per_step = 2", f"prompts_per_step = 2\n{extra}")
    b.write_text(text if extra else text.replace('name = "tiny"', 'name = "tiny"\nalgorithm = "aepo"'))
    assert main([str(a), str(b), "--sft", str(tiny_model_dir), "--output", str(tmp_path / "o"), "--equal-budget"]) == 2
    err = capsys.readouterr().err
    assert f"differ in {field}" in err and "tiny: 1" in err and shown in err
    assert not (tmp_path / "o").exists()


def test_stats_t_interval():
    s = stats([0.5, 0.7, 0.9])
    assert abs(s["mean"] - 0.7) < 1e-12 and abs(s["sd"] - 0.2) < 1e-12
    assert abs(s["ci95"] - 4.303 * 0.2 / 3**0.5) < 1e-9


def test_resume_skips_finished_runs_and_report_only_merges_processes(tiny_model_dir, tmp_path, capsys):
    """Two processes with different --seeds share one --output; a rerun trains nothing that finished; --report-only
    builds one report over both and the quickstart reference from it."""
    exp = write_experiment(tmp_path, tiny_model_dir, iterations=1)
    out = tmp_path / "cmp"
    common = [str(exp), "--sft", str(tiny_model_dir), "--output", str(out), "--no-progress"]
    assert main([*common, "--seeds", "0"]) == 0
    assert main([*common, "--seeds", "1"]) == 0
    first = (out / "tiny" / "seed_0" / "compare_run.json").read_text()
    metrics = (out / "tiny" / "seed_0" / "metrics.jsonl").stat().st_mtime_ns
    ref = tmp_path / "ref.json"
    assert main([*common, "--seeds", "0", "1", "2", "--report-only", "--reference", str(ref)]) == 0
    assert "tiny seed 2: not finished" in capsys.readouterr().err
    assert not (out / "tiny" / "seed_2").exists()  # report-only trains nothing
    assert (out / "tiny" / "seed_0" / "compare_run.json").read_text() == first
    assert (out / "tiny" / "seed_0" / "metrics.jsonl").stat().st_mtime_ns == metrics
    summary = json.loads((out / "report.json").read_text())["summary"]["tiny"]
    assert summary["seeds"] == [0, 1] and summary["after"]["n"] == 2
    reference = json.loads(ref.read_text())
    assert reference["num_seeds"] == 2 and set(reference["configurations"]) == {"tiny"}
    assert reference["configurations"]["tiny"]["seeds"] == 2
    assert reference["configurations"]["tiny"]["after_mean"] == summary["after"]["mean"]
    assert reference["precision"] == "fp32"  # what the runs' learners resolved, printed beside a quickstart's own


def test_two_configurations_report_while_the_second_has_not_run(tiny_model_dir, tmp_path):
    # Regression: the partial report written after the first run divided by the empty second configuration.
    a = write_experiment(tmp_path, tiny_model_dir, iterations=1)
    b = tmp_path / "other.toml"
    b.write_text(a.read_text())
    out = tmp_path / "two"
    assert (
        main(
            [
                str(a),
                str(b),
                "--sft",
                str(tiny_model_dir),
                "--seeds",
                "0",
                "--output",
                str(out),
                "--no-progress",
                "--equal-budget",
            ]
        )
        == 0
    )
    summary = json.loads((out / "report.json").read_text())["summary"]
    assert set(summary) == {"tiny", "other"} and summary["other"]["after"]["n"] == 1


def test_named_variants_share_an_output_and_report_paired_differences(tiny_model_dir, tmp_path, capsys):
    # A stabilizer study: one file, variants made with --set under their own --name, each process its own run;
    # --report-only finds every configuration and --baseline pairs the final accuracies by seed.
    exp = write_experiment(tmp_path, tiny_model_dir, iterations=1)
    out = tmp_path / "stab"
    common = [str(exp), "--sft", str(tiny_model_dir), "--output", str(out), "--no-progress", "--seeds", "0"]
    assert main(common) == 0
    assert main([*common, "--name", "tiny+lr0", "--set", "training.lr=1e-7"]) == 0
    rerun = json.loads((out / "tiny+lr0" / "seed_0" / "rerun.json").read_text())
    assert "training.lr=1e-7" in rerun["command"]
    assert main(["--report-only", "--output", str(out), "--baseline", "tiny"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["summary"]) == {"tiny", "tiny+lr0"}
    pair = report["paired"]["tiny+lr0"]
    after = {n: r["per_seed"]["0"]["after"] for n, r in report["summary"].items()}
    assert pair["seeds"] == [0] and pair["per_seed"]["0"] == after["tiny+lr0"] - after["tiny"]
    # one pair: the exact two-sided p is 1 (a tie dropped, or 2 x 1/2 for a single non-zero difference)
    assert pair["wilcoxon_p"] == 1.0
    assert "paired by seed" in (out / "report.md").read_text()
    capsys.readouterr()
    assert main(["--report-only", "--output", str(out), "--baseline", "nope"]) == 2
    assert "--baseline 'nope' is not a configuration" in capsys.readouterr().err
    assert main([*common, "--name", "../escape"]) == 2
    assert "--name '../escape'" in capsys.readouterr().err and not (tmp_path / "escape").exists()
    assert main(["--output", str(out)]) == 2
    assert "training needs experiment files and --sft" in capsys.readouterr().err


def test_the_comparison_files_train_the_quickstarts_rl_stage():
    """compare_{arpo,grpo,aepo}.toml are the quickstart's RL stage per algorithm: the reference distribution the
    quickstart prints is measured with them, so a recipe change in one file (e.g. the learning rate) must be made in
    all. Allowed to differ: the algorithm and its tree, the evaluation schedule, and memory-only settings."""
    import tomllib
    from pathlib import Path

    from arpo_algo.run.experiment import PACKAGE_EXPERIMENTS_DIR

    root = Path(__file__).resolve().parents[2] / "experiments" / "comparisons"
    quick = tomllib.loads((PACKAGE_EXPERIMENTS_DIR / "quickstart.toml").read_text())
    may_differ = {"experiment": {"algorithm"}, "training": {"gradient_checkpointing"}, "evaluation": {"every"}}
    for budget, suffix in ((4, ""), (8, "_m8")):
        for algo in ("arpo", "grpo", "aepo"):
            cfg = tomllib.loads((root / f"compare_{algo}{suffix}.toml").read_text())
            assert cfg["experiment"]["algorithm"] == algo
            assert cfg["tree"]["budget"] == budget
            for section in ("experiment", "env", "training", "rollouts", "evaluation"):
                drop = may_differ.get(section, set())
                assert {k: v for k, v in cfg[section].items() if k not in drop} == {
                    k: v for k, v in quick[section].items() if k not in drop
                }, (algo + suffix, section)


def test_paired_differences_carry_the_exact_wilcoxon_p():
    # five seeds, every one better: the smallest two-sided p five pairs can give, 2 / 2^5
    base = {s: {"after": 0.5} for s in range(5)}
    rep = {
        "grpo": {"per_seed": base},
        "aepo": {"per_seed": {s: {"after": 0.5 + 0.1 * (s + 1)} for s in range(5)}},
        "mixed": {"per_seed": {s: {"after": 0.5 + (0.1 if s % 2 else -0.1) * (s + 1)} for s in range(5)}},
    }
    pairs = paired(rep, "grpo")
    assert set(pairs) == {"aepo", "mixed"}
    assert pairs["aepo"]["wilcoxon_p"] == 2 / 2**5 and pairs["aepo"]["better"] == 5
    # ranks 1..5 with signs - + - + -: W+ = 2 + 4 = 6, and 13 of the 32 sign patterns have a rank sum <= 6
    assert pairs["mixed"]["wilcoxon_p"] == 2 * 13 / 32 and (pairs["mixed"]["better"], pairs["mixed"]["worse"]) == (2, 3)
