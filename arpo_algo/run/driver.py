"""``arpo train`` (and ``arpo sft``): run an experiment file in-process, with logs, checkpoints and a curve.

A run folder holds::

    config.json          the experiment as resolved (file + --set overrides) and every algorithm setting; under
                         ``compute`` the learner's resolved precision and the CPU's bf16 capability
    metrics.jsonl        one line per iteration (evaluation at iteration 0 = before training, when enabled)
    tb/                  TensorBoard scalars: reward, accuracy, tool calls, branches, entropy around tool results,
                         clip fraction, KL, grad norm, tokens/s, time split, held-out metrics
    checkpoints/iter_N/  data-only checkpoints (the newest ``keep_checkpoints``, see
                         :mod:`arpo_algo.algorithms.checkpoint`); ``policy/`` inside is a plain HF folder
    sandbox.json         the isolation level the Python tool reached (when the environment has one)
    learning_curve.png   training reward and held-out accuracy against the iteration
    result.json          final metrics and paths

No Ray cluster is started unless rollout actors are configured. ``--resume DIR`` continues a killed run from its
newest checkpoint: weights, optimizer, RNG, iteration and the data position all come back, and nothing in the folder is
executed (a folder without ``arpo_checkpoint.json`` is not a checkpoint, whatever it holds). A checkpoint
appears only complete (written and fsynced in a hidden temporary folder, then renamed); temporary folders left by a
killed run are removed on start, and a torn last line of ``metrics.jsonl`` is dropped on resume.
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
from arpo_algo.rollout import learner_metrics as LK
from arpo_algo.rollout import metrics as MK
from arpo_algo.run.recovery import describe, is_node_loss, join_cluster, placement, record_restart, wait_for_resources
from arpo_base.errors import ArpoError

#: Result sections written to TensorBoard and metrics.jsonl (plus the top-level training summary keys).
LOGGED_SECTIONS = tuple(s.rstrip("/") for s in (MK.ROLLOUT, LK.PREFIX, MK.TIMERS, MK.EVALUATION)) + ("data", "diag")
SUMMARY_KEYS = (
    MK.REWARD_MEAN,
    MK.REWARD_MAX,
    MK.ACCURACY,
    MK.TOOL_CALLS_PER_TRAJ,
    MK.RESPONSE_LEN,
    MK.TOKENS_SAMPLED,
    MK.TOKENS_PER_S,
    MK.UPDATE_TOKENS_PER_S,
    MK.NAN_UPDATES_SKIPPED,
)
#: The two curves of a run: training reward and held-out accuracy, as metrics.jsonl names them.
TRAIN_REWARD, EVAL_ACCURACY = MK.TRAIN + MK.REWARD_MEAN, MK.EVALUATION + MK.ACCURACY


# ---------------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(algo: Any, ckpt_root: Path, keep: int) -> Path:
    """Save atomically (write and fsync a hidden temp folder, then rename) and keep the newest ``keep`` checkpoints."""
    from arpo_base.paths import fsync_dir

    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"{CHECKPOINT_PREFIX}{algo.iteration:06d}"
    tmp = ckpt_root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    algo.save_to_path(str(tmp))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(ckpt_root)
    for old in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_stale_temporaries(ckpt_root: Path) -> list[Path]:
    """Remove the hidden temp folders a killed run left (a checkpoint is only ever published by its rename)."""
    stale = sorted(ckpt_root.glob(f".{CHECKPOINT_PREFIX}*.tmp")) if ckpt_root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``; a torn last line (the run was killed while writing it) is dropped with a
    warning, a damaged line before it is an error."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                logging.getLogger(__name__).warning("%s: dropped a torn last line (%d characters)", path, len(line))
                break
            raise ArpoError(
                f"{path}: line {i + 1} is not valid JSON ({e})",
                hint="only the last line can be torn by a killed run; fix or remove the damaged line",
            ) from e
    return rows


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
            walk(MK.TRAIN + key, result[key])
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
    train = [(h["iteration"], h[TRAIN_REWARD]) for h in history if TRAIN_REWARD in h]
    evals = [(h["iteration"], h[EVAL_ACCURACY]) for h in history if EVAL_ACCURACY in h]
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
    import torch

    import arpo_algo
    from arpo_algo.run.experiment import experiment_record
    from arpo_algo.train.device_setup import compute_record, resolve_precision

    record = experiment_record(exp)
    record["arpo_version"] = arpo_algo.__version__
    # the learner resolves the same setting on the same device (arpo_algo.algorithms.base builds it there)
    precision, device = exp.config.settings.training.precision, exp.config.settings.rollouts.device
    record["compute"] = compute_record(
        resolve_precision(precision, torch.device(device)), device, {"training.precision": precision}
    )
    record["output"] = str(out)
    record["rllib_config"] = json.loads(json.dumps(exp.config.to_dict(), default=repr))
    (out / "config.json").write_text(json.dumps(record, indent=2, default=repr))


def train_experiment(
    exp: Any,
    *,
    output: str | Path | None = None,
    resume: str | Path | None = None,
    progress: bool = True,
    evaluate_first: bool = True,
    allow_unisolated_python: bool = False,
) -> dict[str, Any]:
    """Run ``exp`` (an :class:`arpo_algo.run.experiment.Experiment`) to ``exp.run.iterations`` iterations.

    Args:
        exp: The loaded experiment.
        output: Run folder (default: ``exp.output_dir``); must not hold checkpoints unless resuming.
        resume: A run folder to continue from its newest checkpoint (it becomes the output folder).
        progress: Show a tqdm bar.
        evaluate_first: Evaluate before the first iteration (logged as iteration 0) when evaluation is enabled.
        allow_unisolated_python: Run the Python tool below the minimum isolation level (recorded in sandbox.json).

    Returns:
        dict with the final metrics, the held-out accuracy before/after, the checkpoint and policy paths.
    """
    logging.getLogger("ray.rllib").setLevel(logging.ERROR)  # the "new API stack" banner is noise here
    out = Path(resume or output or exp.output_dir).expanduser()
    ckpt_root = out / "checkpoints"
    remove_stale_temporaries(ckpt_root)
    existing = list_checkpoints(ckpt_root)
    if resume is None and existing:
        raise ArpoError(
            f"{out} already holds checkpoints ({existing[-1].name})",
            hint=f"continue it with --resume {out}, or pass another --output",
        )
    if resume is not None and not existing:
        raise ArpoError(f"nothing to resume: {ckpt_root} holds no checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    sandbox = require_sandbox(exp.config, allow_unisolated_python)
    if sandbox is not None:
        (out / "sandbox.json").write_text(json.dumps(sandbox, indent=2))
    rollouts = exp.config.settings.rollouts
    if rollouts.record_trees and rollouts.record_path is None:
        # Outside Tune the Algorithm's logdir is a temp folder; the recorded trees belong to the run folder.
        from arpo_algo.eval.trees import FOLDER

        exp.config.llm_rollouts(record_path=str(out / FOLDER))
    _write_config(exp, out)
    owns_ray = join_cluster()
    try:
        summary = _run(exp, out, ckpt_root, existing, progress, evaluate_first)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    return summary


def _build(exp: Any, checkpoint: Path | None) -> Any:
    """A new algorithm, restored from ``checkpoint`` when given (stopped again if the restore fails)."""
    algo = exp.config.build_algo()
    if checkpoint is not None:
        try:
            algo.restore_from_path(str(checkpoint))
        except BaseException:
            algo.stop()
            raise
    return algo


def _run(
    exp: Any, out: Path, ckpt_root: Path, existing: list[Path], progress: bool, evaluate_first: bool
) -> dict[str, Any]:
    from torch.utils.tensorboard import SummaryWriter
    from tqdm.auto import tqdm

    iterations = exp.run.iterations
    last_ckpt = existing[-1] if existing else None
    algo = _build(exp, last_ckpt)
    history: list[dict[str, float]] = []
    metrics_file = out / "metrics.jsonl"
    if existing:
        # keep the lines of iterations the checkpoint covers: later ones are re-run and written again
        history = [h for h in read_metrics(metrics_file) if h["iteration"] <= algo.iteration]
    metrics_file.write_text("".join(json.dumps(h) + "\n" for h in history))
    (out / "placement.json").write_text(json.dumps([placement(algo)], indent=2))
    writer = SummaryWriter(str(out / "tb"))
    t_start = time.time()
    restarts: list[dict[str, Any]] = []
    try:
        if evaluate_first and algo.config.settings.evaluation.every and algo.iteration == 0:
            ev = {MK.EVALUATION + k: v for k, v in algo.evaluate().items()}
            _record(history, metrics_file, writer, 0, ev)
        bar = tqdm(total=iterations, initial=algo.iteration, desc=exp.run.name, unit="it", disable=not progress)
        while algo.iteration < iterations:
            try:
                result = algo.train()
                scalars = scalar_metrics(result)
                every = exp.run.checkpoint_every
                if (every and algo.iteration % every == 0) or algo.iteration == iterations:
                    last_ckpt = save_checkpoint(algo, ckpt_root, exp.run.keep_checkpoints)
            except Exception as e:  # noqa: BLE001 - only a lost node or actor is retried, anything else re-raised
                if not is_node_loss(e) or len(restarts) >= exp.run.max_restarts:
                    raise
                failed = algo.iteration + 1
                _stop_quietly(algo)
                resumed = int(last_ckpt.name[len(CHECKPOINT_PREFIX) :]) if last_ckpt else 0
                logging.getLogger(__name__).warning(
                    "iteration %d lost a Ray node or actor (%s); restart %d of %d from %s",
                    failed,
                    describe(e),
                    len(restarts) + 1,
                    exp.run.max_restarts,
                    last_ckpt.name if last_ckpt else "the initial weights",
                )
                history = record_restart(restarts, history, failed, resumed, e)
                metrics_file.write_text("".join(json.dumps(h) + "\n" for h in history))
                wait_for_resources(exp.config, exp.run.restart_wait_s)
                algo = _build(exp, last_ckpt)
                bar.n = algo.iteration
                where = json.loads((out / "placement.json").read_text()) + [placement(algo)]
                (out / "placement.json").write_text(json.dumps(where, indent=2))
                continue
            _record(history, metrics_file, writer, algo.iteration, scalars)
            bar.update(1)
            bar.set_postfix(
                {k.split("/")[-1]: f"{scalars[k]:.3f}" for k in (TRAIN_REWARD, EVAL_ACCURACY) if k in scalars}
            )
        bar.close()
    finally:
        writer.close()
        algo.stop()
    curve = plot_learning_curve(history, out / "learning_curve.png")
    evals = [h for h in history if EVAL_ACCURACY in h]
    summary = {
        "name": exp.run.name,
        "algorithm": exp.run.algorithm,
        "seed": exp.run.seed,
        "iterations": iterations,
        "output": str(out),
        "checkpoint": str(last_ckpt) if last_ckpt else None,
        "policy": str(last_ckpt / "policy") if last_ckpt else None,
        "learning_curve": str(curve),
        "accuracy_before": evals[0][EVAL_ACCURACY] if evals and evals[0]["iteration"] == 0 else None,
        "accuracy_after": evals[-1][EVAL_ACCURACY] if evals else None,
        "final": history[-1] if history else {},
        "time_s": round(time.time() - t_start, 1),
        "run": dataclasses.asdict(exp.run),
        "restarts": restarts,
        "rerun_iterations": sum(len(r["rerun_iterations"]) for r in restarts),
    }
    return summary


def _stop_quietly(algo: Any) -> None:
    """Stop an algorithm whose actors may be dead (their errors on the way out change nothing)."""
    try:
        algo.stop()
    except Exception as e:  # noqa: BLE001 - the lost actors cannot be closed; the restart builds new ones
        logging.getLogger(__name__).warning("stopping the broken algorithm: %s", e)


def require_sandbox(config: Any, allow_unisolated_python: bool) -> dict[str, Any] | None:
    """The Python tool's isolation record for this run's environment (None without a Python tool); below the minimum
    a ConfigError unless the user opted in, in which case the opt-in travels in the env config to every worker."""
    import gymnasium as gym

    import arpo_env  # noqa: F401 - registers the ids
    from arpo_env.tools.isolation_checks import require_env_python_isolation

    env_config = dict(config.env_config)
    merged = {**gym.spec(config.env).kwargs, **env_config} if config.env in gym.registry else env_config
    record = require_env_python_isolation(merged, allow_unisolated_python=allow_unisolated_python, context="training")
    if "tools" in merged and merged.get("tools") != env_config.get("tools"):
        config.environment(env_config={**env_config, "tools": merged["tools"]})
    return record


def _record(history: list, metrics_file: Path, writer: Any, iteration: int, scalars: dict[str, float]) -> None:
    row = {"iteration": iteration, **scalars}
    history.append(row)
    with metrics_file.open("a") as f:
        f.write(json.dumps(row) + "\n")
    for key, value in scalars.items():
        writer.add_scalar(key, value, iteration)
    writer.flush()
