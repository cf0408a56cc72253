"""`arpo train`: a tiny experiment file end to end (logs, checkpoints, curve), resume, and clear errors."""

from __future__ import annotations

import json

from arpo_algo.cli.main import main
from arpo_algo.eval.trees import TreeReader


def write_experiment(tmp_path, model_dir, iterations: int = 2, tree: bool = True):
    """The tiny experiment; ``tree=False`` leaves out its [tree] section (a records run refuses one)."""
    p = tmp_path / "tiny.toml"
    tree_section = "[tree]\nbudget = 2\ninitial = 1\n" if tree else ""
    p.write_text(f"""
[experiment]
name = "tiny"
iterations = {iterations}
checkpoint_every = 1
keep_checkpoints = 1

[model]
path = "{model_dir}"

[env]
id = "arpo/ToolMath-v0"
levels = [1]
max_tool_calls = 1

{tree_section}
[training]
prompts_per_step = 1
lr = 1e-4
entropy_coef = 0.01      # the random model never scores: the bonus keeps a gradient so the updates are real

[rollouts]
max_response_tokens = 12
[rollouts.hf]
max_batch_size = 4

[evaluation]
every = 2
num_prompts = 2
""")
    return p


def test_train_resume_and_outputs(tiny_model_dir, tmp_path, capsys):
    import ray
    from transformers import AutoModelForCausalLM

    exp = write_experiment(tmp_path, tiny_model_dir)
    out = tmp_path / "run"
    assert main(["train", str(exp), "--output", str(out), "--no-progress"]) == 0
    assert not ray.is_initialized()
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == str(out / "checkpoints" / "iter_000002" / "policy")
    config = json.loads((out / "config.json").read_text())
    assert config["settings"]["tree"]["budget"] == 2 and config["env"] == "arpo/ToolMath-v0"
    from arpo_algo.train.device_setup import cpu_capability

    # the learner's resolved precision (auto is fp32 on a CPU) and the CPU flags that decide bf16's speed
    assert config["compute"] == {
        "precision": "fp32",
        "setting": {"training.precision": "auto"},
        "device": "cpu",
        "cpu": cpu_capability(),
    }
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # 0 = evaluation before training
    assert "evaluation/accuracy" in rows[0] and "evaluation/accuracy" in rows[2]
    for key in (
        "train/reward_mean",
        "train/tool_calls_per_traj",
        "rollout/branches",
        "learner/clip_frac",
        "learner/loss/kl",
        "learner/grad_norm",
        "train/tokens_per_s",
        "timers/rollout_time",
        "rollout/entropy_after_tool",
        "diag/zero_variance_group_frac",
        "learner/param_change_norm",
        "learner/traj_with_grad_frac",
        "learner/kl_rollout",
        "diag/rollout_entropy",
    ):
        assert key in rows[1], key
    assert any((out / "tb").iterdir())
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["iter_000002"]  # rotation kept the newest
    AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "iter_000002" / "policy")
    result = json.loads((out / "result.json").read_text())
    assert result["accuracy_before"] is not None and result["accuracy_after"] is not None

    # a second plain run into the same folder refuses; --resume continues the iteration count
    assert main(["train", str(exp), "--output", str(out), "--no-progress"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["train", str(exp), "--resume", str(out), "--set", "experiment.iterations=3", "--no-progress"]) == 0
    assert (out / "checkpoints" / "iter_000003").is_dir()
    reader = TreeReader(out)  # trees are recorded by default, into the run folder, across the resume
    assert reader.refresh() == [1, 2, 3] and reader.group(3, 0)["trajectories"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]


def test_bad_input_is_one_clear_line(tiny_model_dir, tmp_path, capsys):
    exp = write_experiment(tmp_path, tiny_model_dir)
    assert main(["train", str(exp), "--set", "tree.bugdet=4", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'bugdet'" in err and "did you mean 'budget'" in err and "Traceback" not in err
    assert (
        main(
            [
                "train",
                str(exp),
                "--set",
                "model.path='/no/such/model'",
                "--no-progress",
                "--output",
                str(tmp_path / "r"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "/no/such/model" in err and "Traceback" not in err
    assert main(["train", "no_such_experiment"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["train", str(exp), "--resume", str(tmp_path / "empty")]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_resume_survives_a_kill_mid_write(tiny_model_dir, tmp_path):
    """What a killed run leaves (a half-written checkpoint folder, a torn last metrics line) does not stop --resume."""
    exp = write_experiment(tmp_path, tiny_model_dir, iterations=1)
    out = tmp_path / "run"
    assert main(["train", str(exp), "--output", str(out), "--no-progress", "--set", "evaluation.every=0"]) == 0
    ckpts = out / "checkpoints"
    (ckpts / ".iter_000002.tmp" / "policy").mkdir(parents=True)  # killed while saving iteration 2
    metrics = out / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"iteration": 2, "train/rew')  # killed while logging it
    assert (
        main(
            [
                "train",
                str(exp),
                "--resume",
                str(out),
                "--set",
                "experiment.iterations=2",
                "--no-progress",
                "--set",
                "evaluation.every=0",
            ]
        )
        == 0
    )
    assert not (ckpts / ".iter_000002.tmp").exists()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_000002"]
