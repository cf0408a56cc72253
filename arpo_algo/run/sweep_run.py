"""Run a validated :class:`~arpo_algo.run.sweep.Sweep` with Ray Tune: one ``tune.Tuner`` per algorithm.

Each trial is the real Algorithm class (its variant's, e.g. ``ARPO``) with its RLlib config dict as ``param_space``;
Tune's machinery does the rest: the searcher (Optuna TPE seeded, or Tune's grid/random generator seeded), ASHA,
checkpoints (the best iteration by the metric and the latest; always one at the end), ``max_failures`` and
``Tuner.restore`` for ``--resume``. Trial folders are short (``arpo_<trial id>``); Tune's own console table is off and
one line per finished trial is printed instead. When the first trials all fail with the same error before reporting
anything, the sweep stops and shows that error once.

Ray: a local Ray with this machine's CPUs is started unless ``RAY_ADDRESS`` names a cluster (then it is joined,
and per-trial resources are checked against the cluster).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

from arpo_algo.run.sweep import Sweep, field_path
from arpo_algo.run.sweep_checks import ranks_every_iteration
from arpo_base.errors import ArpoError
from arpo_base.ray_start import init_ray, ray_address

#: Per algorithm folder: the ids of trials that completed or failed (one per line).
FINISHED_LEDGER = "finished_trials.txt"


def start_ray() -> None:
    """Join ``RAY_ADDRESS`` if set, else start a local Ray with this machine's CPUs (quiet workers)."""
    import ray

    if ray.is_initialized():
        return
    if ray_address():
        init_ray(log_to_driver=False)
    else:  # a Ray of its own, never the one a stale ray_current_cluster file names
        init_ray(
            num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR
        )


def param_space(sweep: Sweep, algorithm: str) -> dict[str, Any]:
    """The RLlib config dict of the base experiment with the knobs replaced by Tune search-space objects."""
    exp = sweep.experiment(algorithm)
    cfg = exp.config
    cfg.num_cpus_for_main_process = sweep.settings.resources_per_trial["cpu"]
    space = cfg.to_dict()
    space["env_config"] = dict(space.get("env_config") or {})
    for knob in sweep.knobs_for(algorithm):
        path = field_path(knob.key)
        target = space
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = knob.domain()
    return space


def knob_values(sweep: Sweep, algorithm: str, config: dict[str, Any]) -> dict[str, Any]:
    """A trial's knob values (``section.key`` -> value) read back from its config dict."""
    out: dict[str, Any] = {}
    for knob in sweep.knobs_for(algorithm):
        value: Any = config
        for part in field_path(knob.key):
            value = value.get(part) if isinstance(value, dict) else None
        out[knob.key] = value
    return out


class FailFast(Exception):
    """Raised inside Tune's loop when the first trials all failed with the same error before any result."""


class SweepMonitor:
    """A Tune Callback and Stopper in one: console line per finished trial; stop when all first trials fail alike."""

    def __init__(self, sweep: Sweep, algorithm: str, total: int) -> None:
        from ray.tune import Callback
        from ray.tune.stopper import Stopper

        monitor = self

        class _Callback(Callback):
            def on_trial_result(self, iteration, trials, trial, result, **info):
                monitor.reported.add(trial.trial_id)

            def on_trial_complete(self, iteration, trials, trial, **info):
                monitor.finished(trial, None)

            def on_trial_error(self, iteration, trials, trial, **info):
                monitor.finished(trial, error_text(trial))
                if monitor.fail_fast is not None:  # no result will come to consult the stopper: end the run here
                    raise FailFast(monitor.fail_fast)

        class _Stopper(Stopper):
            def __call__(self, trial_id, result):
                return result.get("training_iteration", 0) >= sweep.settings.iterations

            def stop_all(self):
                return monitor.fail_fast is not None

        self.sweep, self.algorithm, self.total = sweep, algorithm, total
        self.callback, self.stopper = _Callback(), _Stopper()
        self.done = 0
        self.reported: set[str] = set()
        self.ended: set[str] = set()
        self.errors: list[str] = []
        self.fail_fast: str | None = None

    def finished(self, trial: Any, error: str | None) -> None:
        self.done += 1
        self.ended.add(trial.trial_id)
        ledger = self.sweep.output_dir / self.algorithm / FINISHED_LEDGER
        ledger.parent.mkdir(parents=True, exist_ok=True)
        with ledger.open("a") as f:  # survives Ctrl-C and --resume: which trials really ended
            f.write(trial.trial_id + "\n")
        s = self.sweep.settings
        last = trial.last_result or {}
        iters = int(last.get("training_iteration", 0))
        knobs = knob_values(self.sweep, self.algorithm, trial.config)
        shown = " ".join(f"{k.split('.', 1)[1]}={_fmt(v)}" for k, v in knobs.items())
        if error is not None:
            self.errors.append(error)
            state = f"FAILED: {error.splitlines()[-1][:160] if error else '?'}"
        else:
            metric = _flat(last).get(s.metric)
            early = " (stopped early by ASHA)" if iters < s.iterations else ""
            state = f"{s.metric}={_fmt(metric)} after {iters} it{early}"
        print(
            f"[tune] {self.algorithm} trial {self.done}/{self.total} {trial.trial_id}: {shown} -> {state} "
            f"({last.get('time_total_s', 0):.0f} s)",
            flush=True,
        )
        first = min(2, self.total)
        signatures = {e.splitlines()[-1] if e else "" for e in self.errors}  # the exception line, no actor ids
        if error is not None and len(self.errors) >= first and len(signatures) == 1 and not self.reported:
            self.fail_fast = error


def error_text(trial: Any) -> str:
    """The failed trial's error, as the last lines of its traceback (the same text for the same failure)."""
    path = getattr(trial, "error_file", None) or ""
    p = Path(path) if path else (Path(trial.local_path) / "error.txt" if getattr(trial, "local_path", None) else None)
    if p is not None and p.is_file():
        lines = [x for x in p.read_text(errors="replace").splitlines() if x.strip()]
        tail = [x for x in lines if not x.startswith((" ", "Traceback", "The above exception"))]
        return "\n".join(tail[-3:]) if tail else "\n".join(lines[-3:])
    return str(getattr(trial, "error_msg", "") or "unknown error")


def _flat(result: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in result.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "/"))
        else:
            out[key] = v
    return out


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def check_own_tune_state(path: Path) -> None:
    """Refuse (:class:`ArpoError`) to restore Tune's state from ``path`` unless this user wrote it.

    Invariant: ``Tuner.restore`` deserializes the folder's state through cloudpickle (its pickles, and the JSON of
    ``experiment_state-*.json`` and of the trials, which carry pickled objects too), so it runs whatever code that
    state names. A sweep folder is restored only when every entry in it, whatever its name, is no link, belongs to
    this user and is writable by no other user, and every folder above it belongs to this user or root and is not
    writable by others unless sticky (others may then add entries but not replace this user's): so nothing that
    someone else wrote, or could change or swap between this check and Tune's read, is run as code."""
    me = os.geteuid()

    def refuse(item: Path, what: str) -> None:
        raise ArpoError(
            f"{item} is {what}: restoring the sweep in {path} would deserialize Tune's state from it, and Tune's "
            "state is code",
            hint="resume or report only sweeps you ran yourself, in folders only you can change; run the sweep "
            "again into a new --output",
        )

    for parent in Path(os.path.realpath(path)).parents:
        st = parent.stat()
        if st.st_uid not in (me, 0):
            refuse(parent, f"a folder above the sweep owned by uid {st.st_uid}")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            refuse(parent, "a folder above the sweep that other users may write")
    items = [path]
    for root, dirs, files in os.walk(path):  # links are not followed: each is refused below
        items += [Path(root) / n for n in (*dirs, *files)]
    for item in items:
        st = item.lstat()
        if stat.S_ISLNK(st.st_mode):
            refuse(item, "a link")
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            refuse(item, "neither a file nor a folder")
        if st.st_uid != me:
            refuse(item, f"owned by uid {st.st_uid}")
        if st.st_mode & 0o022:
            refuse(item, "writable by other users")


def build_tuner(sweep: Sweep, algorithm: str, monitor: SweepMonitor, resume: bool) -> Any:
    """A new ``tune.Tuner`` for one algorithm's experiment, or ``Tuner.restore`` of an interrupted one."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    from arpo_algo.algorithms import ALGORITHMS

    s = sweep.settings
    # A grid or random search without a scheduler may evaluate only at the end (sweep_checks): then Tune is not
    # given the metric (it would refuse the iterations without it) and the report ranks the trials' last results.
    ranked = ranks_every_iteration(s)
    storage = str(sweep.output_dir.resolve())
    trainable = ALGORITHMS[algorithm]
    run_config = tune.RunConfig(
        name=algorithm,
        storage_path=storage,
        stop=monitor.stopper,
        verbose=0,
        callbacks=[monitor.callback],
        failure_config=tune.FailureConfig(max_failures=s.max_failures),
        checkpoint_config=tune.CheckpointConfig(
            num_to_keep=1,
            checkpoint_frequency=s.checkpoint_every,
            checkpoint_at_end=True,
            checkpoint_score_attribute=s.metric if ranked else None,
            checkpoint_score_order=s.mode,
        ),
    )
    path = Path(storage) / algorithm
    if resume and tune.Tuner.can_restore(str(path)):
        check_own_tune_state(path)
        tuner = tune.Tuner.restore(str(path), trainable=trainable, param_space=param_space(sweep, algorithm))
        restored = tuner._local_tuner._run_config  # the pickled callbacks/stopper belong to the old process
        restored.callbacks, restored.stop = run_config.callbacks, run_config.stop
        return tuner
    objectives = sweep.objectives
    multi = len(objectives) > 1
    if s.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch(
            metric=list(objectives) if multi else None, mode=list(objectives.values()) if multi else None, seed=s.seed
        )
    else:
        # Tune ignores max_concurrent_trials when the search is a generator it did not build: the limit is set here
        search = BasicVariantGenerator(random_state=s.seed, max_concurrent=s.max_concurrent or 0)
    scheduler = (
        ASHAScheduler(
            time_attr="training_iteration",
            max_t=s.iterations,
            grace_period=s.grace_period,
            reduction_factor=s.reduction_factor,
            metric=s.metric if multi else None,
            mode=s.mode if multi else None,
        )
        if s.scheduler == "asha"
        else FIFOScheduler()
    )
    tune_config = tune.TuneConfig(
        metric=None if multi or not ranked else s.metric,
        mode=None if multi or not ranked else s.mode,
        search_alg=search,
        scheduler=scheduler,
        num_samples=s.num_samples,
        max_concurrent_trials=s.max_concurrent,
        trial_name_creator=lambda t: f"{algorithm}_{t.trial_id}",
        trial_dirname_creator=lambda t: f"{algorithm}_{t.trial_id}",
    )
    return tune.Tuner(
        trainable, param_space=param_space(sweep, algorithm), tune_config=tune_config, run_config=run_config
    )


def run_sweep(sweep: Sweep, *, resume: bool = False) -> dict[str, Any]:
    """Run every algorithm's Tune experiment, then write the reports; returns the summary dict.

    Raises:
        ArpoError: the output folder holds a sweep and ``resume`` is False; every first trial failed alike.
    """
    from arpo_algo.run.sweep_report import write_reports

    root = sweep.output_dir
    if not resume and any((root / a).is_dir() for a in sweep.algorithms):
        raise ArpoError(
            f"{root} already holds this sweep",
            hint="continue it with --resume (same --output), or pass another --output",
        )
    root.mkdir(parents=True, exist_ok=True)
    from arpo_algo.run.driver import require_sandbox

    for algorithm in sweep.algorithms:  # the Python tool's isolation is refused here, not inside every trial
        require_sandbox(sweep.experiment(algorithm).config, allow_unisolated_python=False)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's console table and per-trial banners off (verbose=0)
    for logger in ("ray.tune", "ray.rllib", "ray.train"):
        logging.getLogger(logger).setLevel(logging.CRITICAL)
    start_ray()
    t0 = time.time()
    trials: list[dict[str, Any]] = []
    for algorithm in sweep.algorithms:
        total = sweep.num_trials(algorithm)
        monitor = SweepMonitor(sweep, algorithm, total)
        tuner = build_tuner(sweep, algorithm, monitor, resume)
        try:
            results = tuner.fit()
        except Exception as e:  # noqa: BLE001 - FailFast (possibly wrapped by Tune), or Tune itself gave up
            if monitor.fail_fast is None:
                raise ArpoError(
                    f"Ray Tune stopped the {algorithm} sweep: {str(e).splitlines()[0][:300]}",
                    hint=f"finished trials are kept: continue with arpo tune {sweep.source} --output {root} --resume",
                ) from e
        if monitor.fail_fast is not None:
            raise ArpoError(
                f"every trial of the {algorithm} sweep failed the same way before reporting a "
                f"result; stopped.\n{monitor.fail_fast}",
                hint=f"the base experiment fails on its own: try `arpo train {sweep.base_path}` "
                f"(tracebacks: {root / algorithm}/*/error.txt)",
            )
        trials += collect_trials(sweep, algorithm, results)
        # Ctrl-C: Tune saves its state and returns (stopping running trials); a trial that never ended (per our
        # ledger, over every run of this sweep) or one the searcher had not created yet means it is not done.
        ledger = root / algorithm / FINISHED_LEDGER
        ended = set(ledger.read_text().split()) if ledger.is_file() else set()
        unfinished = len({t["trial_id"] for t in trials if t["algorithm"] == algorithm} - ended)
        unfinished += max(0, total - len(results))
        if unfinished:
            print(
                f"[tune] interrupted with {unfinished} unfinished trial(s); continue with: arpo tune "
                f"{sweep.source} --output {root} --resume",
                flush=True,
            )
            return {"interrupted": True, "output": str(root)}
    summary = write_reports(sweep, trials, wall_s=time.time() - t0)
    return summary


def report_sweep(sweep: Sweep) -> dict[str, Any]:
    """Write the reports of a sweep folder as it stands (finished trials only; no trial runs): after Ctrl-C, or to
    redo tables and plots."""
    from ray import tune

    from arpo_algo.algorithms import ALGORITHMS
    from arpo_algo.run.sweep_report import write_reports

    root = sweep.output_dir
    trials: list[dict[str, Any]] = []
    for algorithm in sweep.algorithms:
        path = root / algorithm
        if not tune.Tuner.can_restore(str(path.resolve())):
            continue
        ledger = path / FINISHED_LEDGER
        ended = set(ledger.read_text().split()) if ledger.is_file() else set()
        check_own_tune_state(path)
        results = tune.Tuner.restore(str(path.resolve()), trainable=ALGORITHMS[algorithm]).get_results()
        trials += [t for t in collect_trials(sweep, algorithm, results) if t["trial_id"] in ended]
    if not trials:
        raise ArpoError(f"{root} holds no finished trial of this sweep")
    wall = max((float(t["last"].get("time_total_s", 0) or 0) for t in trials), default=0.0)
    return write_reports(sweep, trials, wall_s=wall)


def collect_trials(sweep: Sweep, algorithm: str, results: Any) -> list[dict[str, Any]]:
    """One record per trial: knobs, status, iterations, last metrics, the history per iteration, paths."""
    records = []
    analysis = results._experiment_analysis
    by_id = {t.trial_id: t for t in analysis.trials}
    for result in results:
        trial_path = Path(result.path)
        trial_id = trial_path.name[len(algorithm) + 1 :]
        trial = by_id.get(trial_id)
        history = result.metrics_dataframe
        rows = history.to_dict("records") if history is not None else []
        last = dict(result.metrics or {})
        error = None
        if result.error is not None:
            error = error_text(trial) if trial is not None else str(result.error)
        records.append(
            {
                "algorithm": algorithm,
                "trial_id": trial_id,
                "path": str(trial_path),
                "status": trial.status if trial is not None else ("ERROR" if error else "TERMINATED"),
                "knobs": knob_values(sweep, algorithm, result.config or {}),
                "config": result.config or {},
                "last": _flat(last),
                "history": rows,
                "error": error,
                "checkpoint": str(result.checkpoint.path) if result.checkpoint else None,
            }
        )
    return records
