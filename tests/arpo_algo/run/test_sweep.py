"""`arpo tune` without Ray: sweep validation (before Ray starts), beam_size, dry run, seed statistics, Pareto front."""

from __future__ import annotations

import json
import math

import pytest

from arpo_algo.cli.main import main
from arpo_algo.run.sweep import load_sweep
from arpo_algo.run.sweep_report import config_summary, pareto_front, seed_stats, trial_rows
from arpo_base.errors import ConfigError

BASE = """
[experiment]
iterations = 2
[model]
path = "{model}"
[env]
id = "arpo/ToolMath-v0"
levels = [1]
max_tool_calls = 1
[tree]
budget = 2
initial = 1
[training]
prompts_per_step = 1
lr = 1e-4
[rollouts]
max_response_tokens = 12
[rollouts.hf]
max_batch_size = 4
[evaluation]
every = 1
num_prompts = 2
"""


def write_sweep(tmp_path, model_dir, sweep: str, space: str, base_extra: str = "") -> str:
    (tmp_path / "base.toml").write_text(BASE.format(model=model_dir) + base_extra)
    p = tmp_path / "sweep.toml"
    p.write_text(f'[sweep]\nexperiment = "{tmp_path / "base.toml"}"\n{sweep}\n[space]\n{space}\n')
    return str(p)


def test_beam_size_is_branch_factor_plus_one(tmp_path, tiny_model_dir, capsys):
    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        "num_samples = 3",
        '"tree.beam_size" = {choice = [1, 2]}\n"tree.tau" = {uniform = [0.1, 0.9]}',
    )
    sweep = load_sweep(path)
    knob = next(k for k in sweep.knobs if k.key == "tree.branch_factor")
    assert knob.dist == "choice" and knob.args == [0, 1]
    assert any("beam_size" in n and "branch_factor" in n for n in sweep.notes)
    assert main(["tune", path, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "note: tree.beam_size" in out
    info = json.loads(out[out.index("{") :])
    assert info["total_trials"] == 3
    assert "tree.branch_factor ~ choice[0, 1]" in info["space"]["arpo"]


def test_advantage_estimators_are_a_searchable_choice(tmp_path, tiny_model_dir):
    path = write_sweep(
        tmp_path, tiny_model_dir, "num_samples = 2", '"training.advantage" = {choice = ["grpo", "turn"]}'
    )
    sweep = load_sweep(path)
    assert sweep.experiment("arpo", {"training.advantage": "turn"}).config.settings.training.advantage == "turn"


def test_seed_grid_counts_and_grpo_rule(tmp_path, tiny_model_dir):
    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        'search = "grid"\nscheduler = "none"',
        '"experiment.algorithm" = {grid = ["arpo", "grpo"]}\n"experiment.seed" = {grid = [0, 1, 2]}\n'
        '"tree.tau" = {choice = [0.3, 0.6]}',
    )
    sweep = load_sweep(path)
    assert sweep.algorithms == ["arpo", "grpo"]
    assert sweep.num_trials("arpo") == 6 and sweep.num_trials("grpo") == 3  # tau means nothing to GRPO
    grpo = sweep.experiment("grpo", {"experiment.seed": 1})
    tree = grpo.config.settings.tree
    assert tree.initial == tree.budget == 2 and tree.branch_factor == 0


@pytest.mark.parametrize(
    ("sweep", "space", "match", "hint"),
    [
        ("", '"tree.tua" = {uniform = [0.1, 1.0]}', "unknown key 'tua'", "did you mean 'tau'"),
        ("", '"tre.tau" = {uniform = [0.1, 1.0]}', "unknown key 'tre'", "did you mean 'tree'"),
        ("", '"tree.tau" = {uniform = [1.0, 0.1]}', "inverted range", "write [0.1, 1.0]"),
        ("", '"tree.tau" = {uniform = [0.5, 0.5]}', "empty range", None),
        ("", '"tree.tau" = {choice = []}', "non-empty list", None),
        ("", '"tree.tau" = {uniformm = [0.1, 1.0]}', "unknown key 'uniformm'", "did you mean 'uniform'"),
        ("", '"tree.initial" = {choice = [1, 3]}', r"tree.initial=3 \(arpo\) is not a valid experiment", "narrow"),
        ("", '"tree.tau" = {grid = [0.1, 0.2]}', "which Optuna cannot search", None),
        ("resources_per_trial = {cpu = 4096}", '"tree.tau" = {uniform = [0.1, 1.0]}', "needs 4096 CPUs", None),
        ('metric = "reward_meen"', '"tree.tau" = {uniform = [0.1, 1.0]}', "never reported", "reward_mean"),
        ("num_smaples = 2", '"tree.tau" = {uniform = [0.1, 1.0]}', "unknown key 'num_smaples'", "num_samples"),
        ("", '"training.advantage" = {choice = ["grpo", "trun"]}', "'trun' is not a registered", "did you mean 'turn'"),
        (
            "",
            '"tree.branch_policy" = {choice = ["random", "appo"]}\n"tree.appo_threshold" = {uniform = [0.1, 0.5]}',
            "read only by branch_policy 'appo'",
            "narrow",
        ),
    ],
)
def test_bad_sweeps_fail_before_ray(tmp_path, tiny_model_dir, sweep, space, match, hint):
    import ray

    path = write_sweep(tmp_path, tiny_model_dir, sweep, space)
    with pytest.raises(ConfigError, match=match) as info:
        load_sweep(path)
    assert str(tmp_path / "sweep.toml") in info.value.message
    if hint:
        assert hint in (info.value.hint or "")
    assert not ray.is_initialized()


def test_infeasible_rollout_actors_and_eval_metric(tmp_path, tiny_model_dir):
    path = write_sweep(tmp_path, tiny_model_dir, "", '"rollouts.num_rollout_actors" = {choice = [0, 64]}')
    with pytest.raises(ConfigError, match="CPUs"):
        load_sweep(path)
    path = write_sweep(
        tmp_path, tiny_model_dir, 'metric = "evaluation/accuracy"', '"tree.tau" = {uniform = [0.1, 1]}', base_extra=""
    )
    assert load_sweep(path).settings.metric == "evaluation/accuracy"
    with pytest.raises(ConfigError, match="every = 0") as info:  # a held-out metric the base never evaluates
        load_sweep(path, ["evaluation.every=0"])
    assert "evaluation.every" in info.value.hint


def test_held_out_metric_evaluated_only_at_the_end(tmp_path, tiny_model_dir):
    # A grid without a scheduler ranks trials at their end, so evaluating only there is enough (and cheaper); a
    # search or scheduler that reads the metric after every iteration still needs every = 1.
    grid = 'metric = "evaluation/accuracy"\nsearch = "grid"\nscheduler = "none"\niterations = 4'
    path = write_sweep(tmp_path, tiny_model_dir, grid, '"experiment.seed" = {grid = [0, 1]}')
    assert load_sweep(path, ["evaluation.every=4"]).settings.iterations == 4
    assert load_sweep(path, ["evaluation.every=2"]).settings.iterations == 4
    with pytest.raises(ConfigError, match="last iteration does not evaluate") as info:
        load_sweep(path, ["evaluation.every=3"])
    assert '"evaluation.every" = 4' in info.value.hint
    with pytest.raises(ConfigError, match="need it in every iteration") as info:
        load_sweep(path, ["evaluation.every=4", "sweep.scheduler=asha"])
    assert 'scheduler = "none"' in info.value.hint


def test_best_toml_nests_a_subsection_knob(tmp_path, tiny_model_dir):
    # A knob inside a subsection ("model.lora.rank") lands in its own table, as a user would write it, not as a
    # dotted key in [model]; best.toml loads back to the trial's point.
    import tomllib

    from arpo_algo.run.experiment import load_experiment
    from arpo_algo.run.sweep_report import write_best_toml

    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        'search = "grid"',
        '"model.lora.rank" = {grid = [4, 8]}',
        base_extra="[model.lora]\nenabled = true\n",
    )
    sweep = load_sweep(path)
    row = {"algorithm": "arpo", "trial": "t0", "iterations": 2, "model.lora.rank": 8, sweep.settings.metric: 0.5}
    best = write_best_toml(sweep, row, tmp_path / "best.toml")
    model = tomllib.loads(best.read_text())["model"]
    assert model["lora"] == {"enabled": True, "rank": 8} and "lora.rank" not in model
    assert load_experiment(best).config.settings.model.lora.rank == 8


def test_cli_bad_sweep_exit_2_no_traceback(tmp_path, tiny_model_dir, capsys):
    path = write_sweep(tmp_path, tiny_model_dir, "", '"tree.tua" = {uniform = [0.1, 1.0]}')
    assert main(["tune", path, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'tua'" in err and "did you mean 'tau'" in err and "Traceback" not in err
    path = write_sweep(tmp_path, tiny_model_dir, "", '"tree.tau" = {uniform = [0.1, 1.0]}')
    assert main(["tune", path, "--set", "model.path=/nonexistent/model", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/model" in err and "Traceback" not in err


def test_seed_stats_known_numbers():
    s = seed_stats([0.5, 0.7, 0.9])
    t975_2 = 4.302652729911275  # Student t, 2 degrees of freedom, 97.5% quantile
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.7) and s["sd"] == pytest.approx(0.2)
    half = t975_2 * 0.2 / math.sqrt(3)
    assert s["ci_low"] == pytest.approx(0.7 - half) and s["ci_high"] == pytest.approx(0.7 + half)
    one = seed_stats([0.4])
    assert one["mean"] == 0.4 and one["sd"] is None and one["ci_low"] is None


def test_seed_grid_summary_groups_over_seeds(tmp_path, tiny_model_dir):
    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        'search = "grid"\nscheduler = "none"',
        '"experiment.algorithm" = {grid = ["arpo", "grpo"]}\n"experiment.seed" = {grid = [0, 1]}',
    )
    sweep = load_sweep(path)
    m = sweep.settings.metric
    rows = [
        {"algorithm": a, "experiment.seed": seed, m: v, "tool_calls": c, "status": "done"}
        for a, seed, v, c in [
            ("arpo", 0, 0.6, 1.0),
            ("arpo", 1, 0.8, 2.0),
            ("grpo", 0, 0.2, 1.0),
            ("grpo", 1, 0.4, 3.0),
        ]
    ]
    rows.append({"algorithm": "grpo", "experiment.seed": 2, m: None, "tool_calls": None, "status": "error"})
    summary = config_summary(sweep, rows)
    assert [r["algorithm"] for r in summary] == ["arpo", "grpo"]
    arpo, grpo = summary
    half = 12.706204736174698 * math.sqrt(0.02) / math.sqrt(2)  # t(0.975, 1) * sd / sqrt(n)
    assert arpo["seeds"] == 2 and arpo["mean"] == pytest.approx(0.7) and arpo["sd"] == pytest.approx(math.sqrt(0.02))
    assert arpo["ci95_low"] == pytest.approx(0.7 - half) and arpo["ci95_high"] == pytest.approx(0.7 + half)
    assert grpo["mean"] == pytest.approx(0.3) and grpo["tool_calls_mean"] == pytest.approx(2.0)


def test_metric_tie_goes_to_more_training_reward(tmp_path, tiny_model_dir):
    # Four rates tied at 15/32 held-out tasks: the ranking (and best.toml) follows the reward earned while training.
    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        'metric = "evaluation/accuracy"\nsearch = "grid"\nscheduler = "none"',
        '"training.lr" = {grid = [1e-4, 3e-4, 1e-3]}',
        base_extra="",
    )
    sweep = load_sweep(path)
    m = sweep.settings.metric

    def trial(lr, rewards, metric):
        hist = [{"training_iteration": i + 1, "reward_mean": r} for i, r in enumerate(rewards)]
        hist[-1][m] = metric
        return {
            "path": str(tmp_path / f"t{lr}"),
            "algorithm": "arpo",
            "knobs": {"training.lr": lr},
            "error": None,
            "last": {**hist[-1], "training_iteration": 2},
            "history": hist,
        }

    rows = trial_rows(
        sweep, [trial(1e-4, [0.4, 0.5], 0.47), trial(3e-4, [0.5, 0.7], 0.47), trial(1e-3, [0.9, 0.9], 0.30)]
    )
    assert [r["training.lr"] for r in rows] == [3e-4, 1e-4, 1e-3]  # the metric first, then the training reward
    assert rows[0]["train_reward"] == pytest.approx(0.6) and rows[1]["train_reward"] == pytest.approx(0.45)


def test_pareto_front():
    pts = [(0.5, 2.0), (0.5, 1.0), (0.8, 3.0), (0.2, 0.5), (0.4, 3.0)]
    assert pareto_front(pts, "max") == [3, 1, 2]
    assert pareto_front(pts, "min") == [3]


def test_multi_objective_settings(tmp_path, tiny_model_dir):
    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        'objectives = {"evaluation/accuracy" = "max", "evaluation/tool_calls_per_traj" = "min"}',
        '"tree.tau" = {uniform = [0.1, 1.0]}',
    )
    sweep = load_sweep(path)
    assert sweep.objectives == {"evaluation/accuracy": "max", "evaluation/tool_calls_per_traj": "min"}
    assert (sweep.settings.metric, sweep.settings.mode) == ("evaluation/accuracy", "max")  # ASHA, tables, best
    with pytest.raises(ConfigError, match="multi-objective"):
        load_sweep(path, ['sweep.search="random"'])


@pytest.mark.parametrize("name", ["tune_quickstart", "tune_arpo_vs_grpo"])
def test_shipped_sweeps_validate(name, tiny_model_dir, capsys):
    """The example sweeps in experiments/ pass the whole-sweep validation (with a model that exists here)."""
    assert main(["tune", name, "--set", f"model.path={tiny_model_dir}", "--dry-run"]) == 0, capsys.readouterr().err
