"""Sweep files for ``arpo tune``: load, check every point before Ray starts, and build Tune's search spaces.

A sweep is a TOML file beside the experiment files (a bare name finds ``experiments/<name>.toml``)::

    [sweep]    experiment (the base experiment: a name or a path; required), name, output, metric, mode,
               objectives (multi-objective Optuna: {"evaluation/accuracy" = "max", "evaluation/tool_calls_per_traj" =
               "min"}), num_samples, max_concurrent, iterations, seed, search ("optuna" | "grid" | "random"),
               scheduler ("asha" | "none"), grace_period, reduction_factor, resources_per_trial ({cpu = 1, gpu = 0}),
               max_failures, checkpoint_every
    [base]     fixed settings of the base experiment for this sweep: "section.key" = value (like --set)
    [space]    "section.key" = {uniform = [lo, hi]} | {loguniform = [lo, hi]} | {quniform = [lo, hi, q]} |
               {randint = [lo, hi]} (both ends included) | {choice = [...]} | {grid = [...]}

Knob names are the experiment file's own ``section.key`` names; ``tree.beam_size`` (the reference code's name) is
accepted as ``tree.branch_factor + 1`` and converted with a note. ``experiment.algorithm`` may only be a grid: each
algorithm runs as its own Tune experiment (``tune.Tuner(<its Algorithm class>, ...)``) in ``<output>/<algorithm>/``.
For GRPO the tree samples ``budget`` independent trajectories (``initial = budget``, ``branch_factor = 0``), so the
comparison is at equal trajectory budget, and branching knobs are dropped from its space (with a note).

Validation (all before Ray starts, each a ConfigError naming the sweep file): unknown sections/keys (closest valid
name), wrong types, empty or inverted ranges, grids under Optuna, a point of the space that makes the experiment
invalid (every corner of the space is built and validated: discrete values all, ranges at both ends), per-trial
resources larger than the machine (or the cluster at ``RAY_ADDRESS``), a metric the algorithm never reports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo_algo.algorithms.settings import SECTIONS as SETTING_SECTIONS
from arpo_algo.algorithms.settings import Settings
from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout import metrics as MK
from arpo_algo.run import smoke
from arpo_algo.run.experiment import (
    SECTIONS,
    Experiment,
    load_experiment,
    resolve_experiment_path,
)
from arpo_algo.run.sweep_checks import check_metrics, check_points
from arpo_algo.run.tomlw import toml_literal
from arpo_base.errors import ConfigError
from arpo_base.options import parse_override, read_toml, unknown_key_error

#: Every setting's dotted name (what a [space] knob of a settings section may name).
_SETTING_NAMES = frozenset(Settings().flat())
DISTRIBUTIONS = ("uniform", "loguniform", "quniform", "randint", "choice", "grid")
SEARCHES = ("optuna", "grid", "random")
SCHEDULERS = ("asha", "none")
#: Tree knobs that mean nothing to GRPO (dropped from its space).
BRANCHING_KNOBS = (
    "initial",
    "branch_factor",
    "alpha",
    "beta",
    "tau",
    "entropy_tokens",
    "entropy_method",
    "decision_rule",
    "branch_policy",
    "random_rate",
    "random_lookahead",
    "appo_threshold",
    "appo_gain_weight",
    "fillup",
    "max_depth",
)


@dataclass
class SweepSettings:
    """The ``[sweep]`` section (see the module docstring)."""

    experiment: str = ""
    name: str = "sweep"
    output: str | None = None
    metric: str = MK.REWARD_MEAN
    mode: str = "max"
    objectives: dict[str, str] = field(default_factory=dict)
    num_samples: int = 4
    max_concurrent: int = 2
    iterations: int = 3
    seed: int = 0
    search: str = "optuna"
    scheduler: str = "asha"
    grace_period: int = 1
    reduction_factor: int = 2
    resources_per_trial: dict[str, float] = field(default_factory=lambda: {"cpu": 1.0, "gpu": 0.0})
    max_failures: int = 0
    checkpoint_every: int = 1


_TYPES = {
    "experiment": str,
    "name": str,
    "output": str,
    "metric": str,
    "mode": str,
    "objectives": dict,
    "num_samples": int,
    "max_concurrent": int,
    "iterations": int,
    "seed": int,
    "search": str,
    "scheduler": str,
    "grace_period": int,
    "reduction_factor": int,
    "resources_per_trial": dict,
    "max_failures": int,
    "checkpoint_every": int,
}


@dataclass
class Knob:
    """One ``[space]`` entry: ``section.key``, its distribution and its arguments."""

    key: str
    dist: str
    args: list[Any]

    @property
    def corners(self) -> list[Any]:
        """The values every point check covers: all discrete values, both ends of a range."""
        return list(self.args) if self.dist in ("choice", "grid") else list(self.args[:2])

    def domain(self) -> Any:
        """The Tune search-space object."""
        from ray import tune

        a = self.args
        return {
            "uniform": lambda: tune.uniform(a[0], a[1]),
            "loguniform": lambda: tune.loguniform(a[0], a[1]),
            "quniform": lambda: tune.quniform(a[0], a[1], a[2]),
            "randint": lambda: tune.randint(a[0], a[1] + 1),
            "choice": lambda: tune.choice(list(a)),
            "grid": lambda: tune.grid_search(list(a)),
        }[self.dist]()

    def describe(self) -> str:
        return f"{self.key} ~ {self.dist}{self.args}"


@dataclass
class Sweep:
    """A loaded, validated sweep: settings, base sections, knobs per algorithm, notes for the console."""

    settings: SweepSettings
    source: Path | None
    base_path: Path
    base_sections: dict[str, dict[str, Any]]
    knobs: list[Knob]
    algorithms: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def output_dir(self) -> Path:
        return Path(self.settings.output or f"runs/tune/{self.settings.name}").expanduser()

    @property
    def objectives(self) -> dict[str, str]:
        """metric -> mode of every objective (the primary metric first)."""
        return dict(self.settings.objectives) or {self.settings.metric: self.settings.mode}

    def knobs_for(self, algorithm: str) -> list[Knob]:
        out = [k for k in self.knobs if k.key != "experiment.algorithm"]
        if algorithm == "grpo":
            out = [k for k in out if not (k.key.startswith("tree.") and k.key[5:] in BRANCHING_KNOBS)]
        return out

    def sections_for(self, algorithm: str, point: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """The base sections with the algorithm, the GRPO tree rule and a point's values applied."""
        sections = {k: dict(v) for k, v in self.base_sections.items()}
        exp = sections.setdefault("experiment", {})
        exp.update(algorithm=algorithm, iterations=self.settings.iterations)
        exp.setdefault("name", self.base_path.stem)
        for key, value in (point or {}).items():
            # nested like the TOML tables the base was read from ("model.lora.rank" -> [model.lora] rank), so
            # best.toml writes the same table a user would
            section, *path = key.split(".")
            node = sections.setdefault(section, {})
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        if algorithm == "grpo":
            tree = sections.setdefault("tree", {})
            tree["initial"] = tree.get("budget", TreeConfig.budget)
            tree["branch_factor"] = 0
        return sections

    def experiment(self, algorithm: str, point: dict[str, Any] | None = None) -> Experiment:
        return load_experiment(sections=self.sections_for(algorithm, point))

    def num_trials(self, algorithm: str) -> int:
        grid = math.prod(len(k.args) for k in self.knobs_for(algorithm) if k.dist == "grid")
        return grid * self.settings.num_samples


# ------------------------------------------------------------------------------------------------------- loading


def resolve_sweep_path(name_or_path: str | Path) -> Path:
    """A sweep file, or a bare name in experiments/ (same lookup as experiment files)."""
    return resolve_experiment_path(name_or_path)


def load_sweep(name_or_path: str | Path, overrides: list[str] | None = None) -> Sweep:
    """Read a sweep file, apply ``--set`` overrides (``sweep.*`` to the sweep, others to the base), validate."""
    source = resolve_sweep_path(name_or_path)
    where = str(source)
    raw = read_toml(source)
    for section in raw:
        if section not in ("sweep", "base", "space"):
            raise unknown_key_error(section, ("sweep", "base", "space"), f"{where}: section [{section}]")
    body = dict(raw.get("sweep", {}))
    base_over = [f"{k}={toml_literal(v)}" for k, v in raw.get("base", {}).items()]
    for item in overrides or []:
        section, key, value = parse_override(item, ("sweep", "space", *SECTIONS))
        if section == "sweep":
            body[key] = value
        elif section == "space":
            raise ConfigError(
                f"--set {item!r}: the space is set in the sweep file",
                hint="override a base setting (section.key=value) or a sweep setting (sweep.key=...)",
            )
        else:
            base_over.append(item)
    if smoke.smoke():
        smoke.announce(f"sweep {where}")
        body.update(smoke.sweep_budget())
    settings = _settings(body, source, where)
    base_path = resolve_experiment_path(settings.experiment)
    base_raw = read_toml(base_path)
    notes: list[str] = []
    base_over = [_beam_override(o, notes) for o in base_over]
    base_exp = load_experiment(sections=base_raw, overrides=base_over)  # unknown keys, types
    sections = base_exp.sections
    evaluation = sections.get("evaluation", {})
    if smoke.smoke() and int(evaluation.get("every") or 0) > smoke.ITERATIONS:
        # the smoke trial's one iteration evaluates, so a sweep ranked by a held-out metric still reads it at the end
        evaluation["every"] = smoke.ITERATIONS
    sections.setdefault("experiment", {}).setdefault("name", base_path.stem)
    model = Path(str(sections["model"]["path"])).expanduser()
    if model.exists():  # trials run in their own folders: a relative model folder must become absolute
        sections["model"]["path"] = str(model.resolve())
    _apply_resources(settings, sections, where)
    knobs = [_knob(k, v, where, notes) for k, v in raw.get("space", {}).items()]
    if not knobs:
        raise ConfigError(f"{where}: [space] is empty", hint='[space]\n"tree.tau" = {uniform = [0.1, 1.0]}')
    algorithms = [sections["experiment"].get("algorithm", "arpo")]
    for knob in knobs:
        if knob.key == "experiment.algorithm":
            if knob.dist != "grid":
                raise ConfigError(
                    f"{where}: [space] experiment.algorithm must be a grid (each algorithm is its own Tune experiment)",
                    hint='"experiment.algorithm" = {grid = ["arpo", "grpo"]}',
                )
            algorithms = list(knob.args)
    sweep = Sweep(settings, source, base_path, sections, knobs, algorithms, notes)
    _check_search(sweep, where)
    check_points(sweep, where)
    check_metrics(sweep, where)
    return sweep


def _settings(body: dict[str, Any], source: Path, where: str) -> SweepSettings:
    for key, value in body.items():
        if key not in _TYPES:
            raise unknown_key_error(key, _TYPES, f"{where}: [sweep]")
        expected = _TYPES[key]
        if isinstance(value, bool) or not isinstance(value, expected):
            raise ConfigError(f"{where}: [sweep] {key} must be {expected.__name__}, got {value!r}")
    s = SweepSettings(**{"name": source.stem, **body})
    if s.search == "grid" and "num_samples" not in body:
        s.num_samples = 1  # a grid runs each point once unless repeats are asked for
    if not s.experiment:
        raise ConfigError(
            f"{where}: [sweep] experiment (the base experiment) is missing", hint='[sweep]\nexperiment = "quickstart"'
        )
    for key, allowed in (("mode", ("max", "min")), ("search", SEARCHES), ("scheduler", SCHEDULERS)):
        if getattr(s, key) not in allowed:
            raise unknown_key_error(getattr(s, key), allowed, f"{where}: [sweep] {key}")
    for key in ("num_samples", "max_concurrent", "iterations", "grace_period", "reduction_factor"):
        if getattr(s, key) < 1:
            raise ConfigError(f"{where}: [sweep] {key} must be >= 1, got {getattr(s, key)}")
    if s.reduction_factor < 2 and s.scheduler == "asha":
        raise ConfigError(f"{where}: [sweep] reduction_factor must be >= 2 for ASHA")
    if s.max_failures < 0 or s.checkpoint_every < 0:
        raise ConfigError(f"{where}: [sweep] max_failures and checkpoint_every must be >= 0")
    for metric, mode in s.objectives.items():
        if mode not in ("max", "min"):
            raise ConfigError(f'{where}: [sweep] objectives.{metric} must be "max" or "min", got {mode!r}')
    if s.objectives:
        s.metric, s.mode = next(iter(s.objectives.items()))
    return s


def _apply_resources(s: SweepSettings, sections: dict[str, dict[str, Any]], where: str) -> None:
    res = {k.lower(): v for k, v in s.resources_per_trial.items()}
    for key, value in res.items():
        if key not in ("cpu", "gpu"):
            raise unknown_key_error(key, ("cpu", "gpu"), f"{where}: [sweep] resources_per_trial")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{where}: [sweep] resources_per_trial.{key} must be a number >= 0, got {value!r}")
    s.resources_per_trial = {"cpu": float(res.get("cpu", 1.0)), "gpu": float(res.get("gpu", 0.0))}
    if s.resources_per_trial["cpu"] <= 0:
        raise ConfigError(f"{where}: [sweep] resources_per_trial.cpu must be > 0")
    if s.resources_per_trial["gpu"] > 0:
        sections.setdefault("rollouts", {})["device"] = "cuda"


def _beam_override(item: str, notes: list[str]) -> str:
    section, key, value = parse_override(item, SECTIONS)
    if (section, key) != ("tree", "beam_size"):
        return item
    notes.append(
        f"tree.beam_size={value} is the reference code's name: using tree.branch_factor={value - 1} "
        "(beam_size = branch_factor + 1, docs/concepts/arpo.md#branching-parameters)"
    )
    return f"tree.branch_factor={value - 1}"


def _knob(key: str, spec: Any, where: str, notes: list[str]) -> Knob:
    at = f"{where}: [space] {key!r}"
    if key.count(".") < 1:
        raise ConfigError(f"{at}: knobs are section.key names", hint='e.g. "tree.tau" or "training.lr"')
    section, name = key.split(".", 1)
    if section not in SECTIONS:
        raise unknown_key_error(section, SECTIONS, f"{at}: section")
    allowed: set[str] | None = None  # None: checked by the environment's own config ([env])
    if section in SETTING_SECTIONS:
        allowed = {k.partition(".")[2] for k in _SETTING_NAMES if k.startswith(section + ".")}
        allowed |= {"beam_size"} if section == "tree" else set()
    elif section == "experiment":
        allowed = {"seed", "algorithm"}
    if allowed is not None and name not in allowed:
        hint = unknown_key_error(name, allowed, at).hint
        if section == "experiment" and name == "iterations":
            hint = "iterations are set by [sweep] iterations"
        raise ConfigError(f"{at}: unknown key {name!r}", hint=hint)
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ConfigError(
            f"{at}: expected one distribution {{name = [...]}}", hint=f"one of {', '.join(DISTRIBUTIONS)}"
        )
    dist, args = next(iter(spec.items()))
    if dist not in DISTRIBUTIONS:
        raise unknown_key_error(dist, DISTRIBUTIONS, f"{at}: distribution")
    if not isinstance(args, list) or not args:
        raise ConfigError(f"{at}: {dist} needs a non-empty list of values, got {args!r}")
    if dist in ("choice", "grid"):
        if len({repr(a) for a in args}) != len(args):
            raise ConfigError(f"{at}: {dist} lists a value twice: {args}")
    else:
        n = 3 if dist == "quniform" else 2
        if len(args) != n or any(isinstance(a, bool) or not isinstance(a, (int, float)) for a in args):
            raise ConfigError(f"{at}: {dist} needs {n} numbers, got {args!r}")
        if dist == "randint" and any(not isinstance(a, int) for a in args):
            raise ConfigError(f"{at}: randint needs integers, got {args!r}")
        lo, hi = args[0], args[1]
        if lo > hi:
            raise ConfigError(f"{at}: inverted range [{lo}, {hi}]", hint=f"write [{hi}, {lo}]")
        if lo == hi:
            raise ConfigError(f"{at}: empty range [{lo}, {hi}]", hint="fix the value in [base] instead")
        if dist == "loguniform" and lo <= 0:
            raise ConfigError(f"{at}: loguniform needs lo > 0, got {lo}")
        if dist == "quniform" and args[2] <= 0:
            raise ConfigError(f"{at}: quniform needs q > 0")
    if key == "tree.beam_size":
        if dist in ("uniform", "loguniform", "quniform"):
            raise ConfigError(f"{at}: beam_size is an integer: use choice, grid or randint")
        if any(not isinstance(a, int) or a < 1 for a in args):
            raise ConfigError(f"{at}: beam_size values must be integers >= 1, got {args}")
        new = [a - 1 for a in args]
        notes.append(
            f"tree.beam_size {dist}{args} is the reference code's name: sweeping tree.branch_factor "
            f"{dist}{new} (beam_size = branch_factor + 1, docs/concepts/arpo.md#branching-parameters)"
        )
        return Knob("tree.branch_factor", dist, new)
    return Knob(key, dist, list(args))


def _check_search(sweep: Sweep, where: str) -> None:
    s = sweep.settings
    grids = [k.key for k in sweep.knobs if k.dist == "grid" and k.key != "experiment.algorithm"]
    if s.search == "optuna" and grids:
        raise ConfigError(
            f"{where}: [space] {grids[0]} is a grid, which Optuna cannot search",
            hint='use {choice = [...]} with search = "optuna", or search = "random"/"grid"',
        )
    if s.search == "grid":
        bad = [k.key for k in sweep.knobs if k.dist not in ("grid", "choice")]
        if bad:
            raise ConfigError(f'{where}: search = "grid" needs grid or choice knobs; {bad[0]} is a range')
        for k in sweep.knobs:
            k.dist = "grid"
    if s.objectives and (s.search != "optuna" or len(s.objectives) < 2):
        raise ConfigError(f'{where}: [sweep] objectives (multi-objective) needs search = "optuna" and >= 2 metrics')
    if sweep.settings.output is None:
        sweep.settings.output = f"runs/tune/{s.name}"


def field_path(knob_key: str) -> tuple[str, ...]:
    """Where a knob lives in the RLlib config dict Tune passes to the Algorithm: a setting under its own dotted name
    (``tree.tau``), an environment key in ``env_config``, ``experiment.seed`` as RLlib's ``seed``."""
    section, name = knob_key.split(".", 1)
    if section == "env":
        return ("env_config", name)
    if section == "experiment":
        return (name,)
    return (knob_key,)


def describe(sweep: Sweep) -> dict[str, Any]:
    """What ``--dry-run`` prints: the resolved space, the trial count per algorithm, settings and notes."""
    return {
        "sweep": str(sweep.source),
        "base": str(sweep.base_path),
        "output": str(sweep.output_dir),
        "settings": dataclasses.asdict(sweep.settings),
        "space": {a: [k.describe() for k in sweep.knobs_for(a)] for a in sweep.algorithms},
        "trials": {a: sweep.num_trials(a) for a in sweep.algorithms},
        "total_trials": sum(sweep.num_trials(a) for a in sweep.algorithms),
        "notes": sweep.notes,
    }
