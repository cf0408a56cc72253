"""``arpo train`` (and ``arpo sft``): run an experiment file in-process, with logs, checkpoints and a curve.

A run folder holds::

    config.json          the experiment as resolved (file + --set overrides) and every algorithm setting
    metrics.jsonl        one line per iteration (evaluation at iteration 0 = before training, when enabled)
    tb/                  TensorBoard scalars: reward, accuracy, tool calls, branches, entropy around tool results,
                         clip fraction, KL, grad norm, tokens/s, time split, held-out metrics
    checkpoints/iter_N/  RLlib checkpoints (the newest ``keep_checkpoints``); ``policy/`` inside is a plain HF folder
    learning_curve.png   training reward and held-out accuracy against the iteration
    result.json          final metrics and paths

No Ray cluster is started unless rollout actors are configured. ``--resume DIR`` continues a killed run from its
newest checkpoint: weights, optimizer, RNG, iteration and the data position all come back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from arpo_algo.models.checkpoints import CHECKPOINT_PREFIX, list_checkpoints
from arpo_base.errors import ArpoError

#: Result sections written to TensorBoard and metrics.jsonl (plus the top-level training summary keys).
LOGGED_SECTIONS = ("rollout", "learner", "timers", "evaluation", "data", "diag")
SUMMARY_KEYS = ("reward_mean", "reward_max", "accuracy", "tool_calls_per_traj", "response_len",
                "tokens_sampled", "tokens_per_s", "update_tokens_per_s", "nan_updates_skipped")


# ---------------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(algo: Any, ckpt_root: Path, keep: int) -> Path:
    """Save atomically (write to a temp folder, then rename) and keep only the newest ``keep`` checkpoints."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"{CHECKPOINT_PREFIX}{algo.iteration:06d}"
    tmp = ckpt_root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    algo.save_to_path(str(tmp))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# -------------------------------------------------------------------------------------------------------- metrics


def scalar_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The finite scalars of a train() result under slash names ("rollout/branches", "evaluation/accuracy")."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value)):
            out[prefix] = float(value)

    for key in SUMMARY_KEYS:
        if key in result:
            walk(f"train/{key}", result[key])
    for section in LOGGED_SECTIONS:
        if section in result:
            walk(section, result[section])
    return out


def plot_learning_curve(history: list[dict[str, float]], path: Path) -> Path:
    """PNG with the training reward and the held-out accuracy against the iteration (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(h["iteration"], h["train/reward_mean"]) for h in history if "train/reward_mean" in h]
    evals = [(h["iteration"], h["evaluation/accuracy"]) for h in history if "evaluation/accuracy" in h]
    if train:
        ax.plot(*zip(*train), label="training reward (mean)", color="tab:blue")
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out accuracy", color="tab:orange")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------------ the run


def _write_config(exp: Any, out: Path) -> None:
    import arpo_algo
    from arpo_algo.run.experiment import experiment_record

    record = experiment_record(exp)
    record["arpo_version"] = arpo_algo.__version__
    record["output"] = str(out)
    record["rllib_config"] = json.loads(json.dumps(exp.config.to_dict(), default=repr))
    (out / "config.json").write_text(json.dumps(record, indent=2, default=repr))


def train_experiment(exp: Any, *, output: str | Path | None = None, resume: str | Path | None = None,
                     progress: bool = True, evaluate_first: bool = True) -> dict[str, Any]:
    """Run ``exp`` (an :class:`arpo_algo.run.experiment.Experiment`) to ``exp.run.iterations`` iterations.

    Args:
        exp: The loaded experiment.
        output: Run folder (default: ``exp.output_dir``); must not hold checkpoints unless resuming.
        resume: A run folder to continue from its newest checkpoint (it becomes the output folder).
        progress: Show a tqdm bar.
        evaluate_first: Evaluate before the first iteration (logged as iteration 0) when evaluation is enabled.

    Returns:
        dict with the final metrics, the held-out accuracy before/after, the checkpoint and policy paths.
    """
    from torch.utils.tensorboard import SummaryWriter
    from tqdm.auto import tqdm

    logging.getLogger("ray.rllib").setLevel(logging.ERROR)  # the "new API stack" banner is noise here
    out = Path(resume or output or exp.output_dir).expanduser()
    ckpt_root = out / "checkpoints"
    existing = list_checkpoints(ckpt_root)
    if resume is None and existing:
        raise ArpoError(f"{out} already holds checkpoints ({existing[-1].name})",
                        hint=f"continue it with --resume {out}, or pass another --output")
    if resume is not None and not existing:
        raise ArpoError(f"nothing to resume: {ckpt_root} holds no checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    rollouts = exp.config.settings.rollouts
    if rollouts.dump_trees and rollouts.dump_path is None:
        # Outside Tune the Algorithm's logdir is a temp folder; tree dumps belong to the run folder.
        exp.config.llm_rollouts(dump_path=str(out / "trees.jsonl"))
    _write_config(exp, out)
    iterations = exp.run.iterations
    algo = exp.config.build_algo()
    history: list[dict[str, float]] = []
    metrics_file = out / "metrics.jsonl"
    if existing:
        algo.restore_from_path(str(existing[-1]))
        if metrics_file.is_file():  # keep the lines of iterations the checkpoint already covers
            lines = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()]
            history = [h for h in lines if h["iteration"] <= algo.iteration]
    metrics_file.write_text("".join(json.dumps(h) + "\n" for h in history))
    writer = SummaryWriter(str(out / "tb"))
    t_start = time.time()
    last_ckpt = existing[-1] if existing else None
    try:
        if evaluate_first and algo.config.settings.evaluation.every and algo.iteration == 0:
            ev = {f"evaluation/{k}": v for k, v in algo.evaluate().items()}
            _record(history, metrics_file, writer, 0, ev)
        bar = tqdm(total=iterations, initial=algo.iteration, desc=exp.run.name, unit="it", disable=not progress)
        while algo.iteration < iterations:
            result = algo.train()
            scalars = scalar_metrics(result)
            _record(history, metrics_file, writer, algo.iteration, scalars)
            bar.update(1)
            bar.set_postfix({k.split("/")[-1]: f"{scalars[k]:.3f}" for k in
                             ("train/reward_mean", "evaluation/accuracy") if k in scalars})
            every = exp.run.checkpoint_every
            if (every and algo.iteration % every == 0) or algo.iteration == iterations:
                last_ckpt = save_checkpoint(algo, ckpt_root, exp.run.keep_checkpoints)
        bar.close()
    finally:
        writer.close()
        algo.stop()
    curve = plot_learning_curve(history, out / "learning_curve.png")
    evals = [h for h in history if "evaluation/accuracy" in h]
    summary = {
        "name": exp.run.name, "algorithm": exp.run.algorithm, "seed": exp.run.seed, "iterations": iterations,
        "output": str(out), "checkpoint": str(last_ckpt) if last_ckpt else None,
        "policy": str(last_ckpt / "policy") if last_ckpt else None, "learning_curve": str(curve),
        "accuracy_before": evals[0]["evaluation/accuracy"] if evals and evals[0]["iteration"] == 0 else None,
        "accuracy_after": evals[-1]["evaluation/accuracy"] if evals else None,
        "final": history[-1] if history else {}, "time_s": round(time.time() - t_start, 1),
        "run": dataclasses.asdict(exp.run),
    }
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    return summary


def _record(history: list, metrics_file: Path, writer: Any, iteration: int, scalars: dict[str, float]) -> None:
    row = {"iteration": iteration, **scalars}
    history.append(row)
    with metrics_file.open("a") as f:
        f.write(json.dumps(row) + "\n")
    for key, value in scalars.items():
        writer.add_scalar(key, value, iteration)
    writer.flush()
