"""The sweep checks that need whole experiments: every corner point, per-trial resources, reported metrics.

Split from :mod:`arpo_algo.run.sweep` (which calls them from ``load_sweep``); ``sweep`` is a
:class:`arpo_algo.run.sweep.Sweep`.
"""

from __future__ import annotations

import itertools
from typing import Any

from arpo_algo.rollout import metrics as MK
from arpo_base.errors import ArpoError, ConfigError
from arpo_base.options import unknown_key_error

#: Training metrics every iteration reports (top level of the result; ``rollout/*`` and ``learner/*`` too).
TRAIN_METRICS = (
    MK.REWARD_MEAN,
    MK.REWARD_MAX,
    MK.ACCURACY,
    MK.TOOL_CALLS_PER_TRAJ,
    MK.GROUP_BRANCHES,
    MK.RESPONSE_LEN,
    MK.TOKENS_SAMPLED,
    MK.TRAJECTORIES,
    MK.TOKENS_PER_S,
    MK.UPDATE_TOKENS_PER_S,
    MK.TRAJECTORIES_LIFETIME,
    *(MK.TIMERS + t for t in (MK.SYNC_TIME, MK.ROLLOUT_TIME, MK.UPDATE_TIME)),
)
#: Held-out metrics (``result["evaluation"]``), reported in iterations where ``[evaluation] every`` divides.
EVAL_METRICS = (
    MK.ACCURACY,
    MK.PASS_AT_K,
    MK.REWARD_MEAN,
    MK.REWARD_MAX,
    MK.TOOL_CALLS_PER_TRAJ,
    MK.FORMAT_OK,
    MK.RESPONSE_LEN,
    MK.TOKENS_SAMPLED,
    MK.TRAJECTORIES,
    MK.NUM_TASKS,
    MK.SAMPLES_PER_TASK,
    MK.EVAL_TIME_S,
)
#: Most corner points built and validated per algorithm.
MAX_CORNERS = 256


def check_points(sweep: Any, where: str) -> None:
    """Build and validate the base, then every corner of the space, per algorithm; check resources."""
    from arpo_algo.algorithms.components import check_resources_feasible, resource_bundles
    from arpo_algo.models import resolve_model_path

    models_seen: set[str] = set()

    for algorithm in sweep.algorithms:
        knobs = sweep.knobs_for(algorithm)
        dropped = sorted({k.key for k in sweep.knobs if k.key != "experiment.algorithm"} - {k.key for k in knobs})
        if dropped:
            sweep.notes.append(
                f"{algorithm}: {', '.join(dropped)} dropped (GRPO does not branch: initial = budget, branch_factor = 0)"
            )
        try:
            base = sweep.experiment(algorithm)
            base.config.validate()
        except ConfigError as e:
            raise ConfigError(
                f"{where}: the base experiment {sweep.base_path} is invalid for {algorithm}: {e.message}", hint=e.hint
            ) from e
        corners = itertools.islice(itertools.product(*[k.corners for k in knobs]), MAX_CORNERS)
        for values in corners:
            point = {k.key: v for k, v in zip(knobs, values)}
            try:
                exp = sweep.experiment(algorithm, point)
                exp.config.validate()
            except ConfigError as e:
                shown = ", ".join(f"{k}={v!r}" for k, v in point.items())
                raise ConfigError(
                    f"{where}: the point {shown} ({algorithm}) is not a valid experiment: {e.message}",
                    hint=(f"{e.hint}; " if e.hint else "")
                    + "narrow the [space] so that every point is valid (the sweep checks every "
                    "corner of the space before Ray starts, and skips none)",
                ) from e
            cfg = exp.config
            model_path = cfg.settings.model.path
            if model_path not in models_seen:
                models_seen.add(model_path)
                try:
                    resolved = resolve_model_path(model_path)
                    if cfg.settings.model.lora.enabled:  # target modules against the config (no weight is read)
                        from arpo_algo.models.lora import resolve_targets

                        resolve_targets(cfg.settings.model.lora, resolved)
                except ArpoError as e:
                    raise ConfigError(f"{where}: model {model_path!r}: {e.message}", hint=e.hint) from e
            cfg.num_cpus_for_main_process = sweep.settings.resources_per_trial["cpu"]
            try:
                backend = cfg.settings.backend
                check_resources_feasible(resource_bundles(cfg), backend.learner_workers if backend.distributed else 0)
            except ConfigError as e:
                prefix = "this ARPO config "
                raise ConfigError(
                    f"{where}: [sweep] resources_per_trial: one trial {e.message[len(prefix) :]}"
                    if e.message.startswith(prefix)
                    else f"{where}: {e.message}",
                    hint=e.hint,
                ) from e


def check_metrics(sweep: Any, where: str) -> None:
    every = sweep.base_sections.get("evaluation", {}).get("every", 0)
    swept_every = any(k.key == "evaluation.every" for k in sweep.knobs)
    known = list(TRAIN_METRICS) + [f"evaluation/{m}" for m in EVAL_METRICS]
    for metric in sweep.objectives:
        if metric.startswith(("rollout/", "learner/")) and metric.count("/") == 1:
            continue
        if metric not in known:
            raise unknown_key_error(metric, known, f"{where}: [sweep] metric (never reported by the algorithm)")
        if metric.startswith("evaluation/") and (swept_every or every != 1):
            _check_sparse_metric(sweep, metric, every, swept_every, where)


def ranks_every_iteration(settings: Any) -> bool:
    """Whether Tune itself reads the metric after each iteration: an Optuna search or ASHA do; a grid or random
    search without a scheduler only ranks the trials at their end (:mod:`arpo_algo.run.sweep_report`)."""
    return settings.search == "optuna" or settings.scheduler != "none"


def _check_sparse_metric(sweep: Any, metric: str, every: int, swept_every: bool, where: str) -> None:
    """A held-out metric evaluated every k iterations: fine when nothing ranks trials before their end and the
    last iteration evaluates; otherwise one error saying which of the two fails."""
    s = sweep.settings
    if ranks_every_iteration(s):
        raise ConfigError(
            f"{where}: [sweep] metric {metric!r} is reported only in iterations that evaluate, "
            f"and the base has [evaluation] every = {every}; the {s.search} search and the "
            f"{s.scheduler} scheduler need it in every iteration",
            hint='[base]\n"evaluation.every" = 1\n(or search = "grid" with scheduler = "none", '
            "which reads the metric only at the end of each trial)",
        )
    if swept_every or every < 1 or s.iterations % every:
        raise ConfigError(
            f"{where}: [sweep] metric {metric!r} is read at the end of each trial, but with "
            f"[evaluation] every = {'<swept>' if swept_every else every} and iterations = "
            f"{s.iterations} the last iteration does not evaluate",
            hint=f'[base]\n"evaluation.every" = {s.iterations}  (or any divisor of the iterations)',
        )
