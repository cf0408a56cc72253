"""Experiment files: one strict TOML format whose keys are the settings' own dotted names.

An experiment file (``experiments/<group>/<name>.toml``) has these sections, all optional except ``[model]`` and
``[env]``; every section but ``[experiment]`` and ``[env]`` is a dataclass of :mod:`arpo_algo.algorithms.settings`,
and its keys are that dataclass's fields::

    [experiment]     name, algorithm (a registered variant), seed, iterations, output, checkpoint_every,
                     keep_checkpoints, description                              -> :class:`ExperimentConfig`
    [model]          path                                                       -> ModelConfig
    [env]            id (a registered env id); every other key goes to env_config -> .environment(...)
    [tree]           branching                                                  -> TreeConfig
    [training]       the learner, prompts per step                              -> TrainingConfig
    [backend]        where the learner runs (local, ddp, deepspeed)             -> BackendConfig
    [rollouts]       sampling, engine, resources                                -> RolloutsConfig
    [rollouts.hf]    HF engine settings                                         -> HFEngineConfig
    [rollouts.vllm]  vLLM engine settings                                       -> VLLMEngineConfig
    [evaluation]     every, split, num_prompts, samples, temperature, max_response_tokens -> EvaluationConfig

Unknown sections and keys are errors naming the file, the section and the closest valid key; wrong types are errors
naming the key. ``env_config`` keys are checked by the environment's own config. Overrides (``--set
section.key=value``, ``--set rollouts.hf.decode=static``) use the same names and are parsed as TOML values
(:func:`arpo_base.options.parse_override`, the parser every command uses).

A decaying learning-rate schedule spans the run's optimizer steps: ``[training] schedule_iterations`` defaults to
``iterations``, and the learner makes that ``iterations x ppo_epochs x mini_batches`` steps (an explicit
``total_steps`` wins). Bare experiment names are looked up in :func:`experiment_dirs`, each folder with its
subfolders: ``$ARPO_EXPERIMENTS``, ``./experiments``, the source checkout's ``experiments/``, then the experiments
shipped with the package (the quickstart's).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo_algo.algorithms import CONFIG_CLASSES, ARPOConfig
from arpo_algo.algorithms.settings import SECTIONS as SETTING_SECTIONS
from arpo_algo.run import smoke
from arpo_base.errors import ArpoError, ConfigError
from arpo_base.options import (
    apply_overrides,
    check_choice,
    check_keys,
    dataclass_from_dict,
    read_toml,
    unknown_key_error,
)
from arpo_base.paths import source_checkout

__all__ = [
    "SECTIONS",
    "Experiment",
    "ExperimentConfig",
    "build_config",
    "experiment_dirs",
    "experiment_record",
    "load_experiment",
    "resolve_experiment_path",
]

#: The source checkout's experiments/ folder (None in a wheel install, which has no checkout).
_CHECKOUT = source_checkout(Path(__file__).resolve().parents[1])
EXPERIMENTS_DIR: Path | None = _CHECKOUT / "experiments" if _CHECKOUT else None
#: The experiments shipped inside the package (the quickstart's), found in a wheel install too.
PACKAGE_EXPERIMENTS_DIR = Path(__file__).resolve().parent / "recipes"
#: Environment variable with extra folders (os.pathsep-separated) searched for experiment names first.
EXPERIMENTS_ENV = "ARPO_EXPERIMENTS"

#: The sections of an experiment file: the run's own two, then every settings section.
SECTIONS = ("experiment", "env", *SETTING_SECTIONS)


@dataclass
class ExperimentConfig:
    """The ``[experiment]`` section: how ``arpo train`` drives the algorithm (not part of ARPOConfig).

    Attributes:
        name: Run name (default: the file's stem); also the default output folder ``runs/<name>``.
        algorithm: A registered variant ("arpo", "grpo", ...: :mod:`arpo_algo.algorithms.variants`): picks its
            config class.
        seed: Seed of everything (data order, sampling, branch draws, learner RNG).
        iterations: Training iterations (one iteration = prompts_per_step prompts sampled and one update).
        output: Run folder: config.json, metrics.jsonl, tb/, checkpoints/, learning_curve.png.
        checkpoint_every: Save a checkpoint every N iterations (the last iteration is always saved).
        keep_checkpoints: Keep only the newest N checkpoints in ``<output>/checkpoints``.
        description: Free text, shown in config.json.
        max_restarts: Restarts from the newest checkpoint after a Ray node or actor was lost mid-iteration (the
            re-run iterations replace their lines in metrics.jsonl and are listed in result.json); 0 = fail at once.
        restart_wait_s: How long a restart waits for the cluster to offer the run's resources again.
    """

    name: str = "experiment"
    algorithm: str = "arpo"
    seed: int = 0
    iterations: int = 10
    output: str | None = None
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    description: str = ""
    max_restarts: int = 2
    restart_wait_s: float = 120.0

    def validate(self, where: str) -> None:
        """Range checks with the file name in the message."""
        check_choice("algorithm", self.algorithm, tuple(CONFIG_CLASSES), f"{where}: [experiment]")
        for name in ("iterations", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}: [experiment] {name} must be >= 1, got {getattr(self, name)}")
        if self.max_restarts < 0 or self.restart_wait_s < 0:
            raise ConfigError(f"{where}: [experiment] max_restarts and restart_wait_s must be >= 0")
        if self.checkpoint_every < 0:
            raise ConfigError(f"{where}: [experiment] checkpoint_every must be >= 0 (0 = only at the end)")


@dataclass
class Experiment:
    """A loaded experiment: run settings, the algorithm config, and the sections it came from (after overrides)."""

    run: ExperimentConfig
    config: ARPOConfig
    sections: dict[str, dict[str, Any]]
    source: Path | None = None
    overrides: list[str] = field(default_factory=list)

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output or f"runs/{self.run.name}").expanduser()


def experiment_dirs() -> list[Path]:
    """Where bare experiment names are looked up, in order: the folders in ``$ARPO_EXPERIMENTS``, ``./experiments``
    (the working directory's), the source checkout's ``experiments/`` (when arpo runs from a checkout), and the
    package's own experiments. Each folder is searched with its subfolders."""
    dirs = [Path(d).expanduser() for d in os.environ.get(EXPERIMENTS_ENV, "").split(os.pathsep) if d]
    dirs.append(Path.cwd() / "experiments")
    if EXPERIMENTS_DIR is not None:
        dirs.append(EXPERIMENTS_DIR)
    dirs.append(PACKAGE_EXPERIMENTS_DIR)
    unique: dict[Path, Path] = {}
    for d in dirs:
        unique.setdefault(d.resolve(), d)
    return list(unique.values())


def _files_named(folder: Path, name: str) -> list[Path]:
    """``<name>.toml`` (or ``name`` itself when it ends in .toml) in ``folder`` and every subfolder of it."""
    if not folder.is_dir():
        return []
    filename = name if name.endswith(".toml") else f"{name}.toml"
    return sorted(p for p in folder.rglob(filename) if p.is_file())


def resolve_experiment_path(name_or_path: str | Path) -> Path:
    """A path to an existing file, or a bare name looked up as ``<name>.toml`` in :func:`experiment_dirs` (the first
    folder holding it wins; two files of that name under one folder are an error naming both)."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    dirs = experiment_dirs()
    name = str(name_or_path)
    if "/" not in name and os.sep not in name:
        for d in dirs:
            found = _files_named(d, name)
            if len(found) > 1:
                raise ArpoError(
                    f"experiment {name!r} is ambiguous: {' and '.join(str(f) for f in found)} both have that name",
                    hint="pass the file's path instead of its name, or rename one",
                )
            if found:
                return found[0]
    known = sorted({f.stem for d in dirs if d.is_dir() for f in d.rglob("*.toml")})
    searched = ", ".join(str(d) for d in dirs)
    hint = (
        f"known experiments: {', '.join(known)}; for a file elsewhere pass its path, or add its folder to "
        f"{EXPERIMENTS_ENV}"
    )
    raise ArpoError(f"experiment {name!r} not found: neither a file nor <name>.toml under {searched}", hint=hint)


def load_experiment(
    name_or_path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    sections: dict[str, dict[str, Any]] | None = None,
) -> Experiment:
    """Read an experiment file (or take ``sections`` directly), apply ``--set`` overrides, build the config.

    Raises:
        ConfigError: an unknown section or key (naming the file and the closest valid key), or a wrong type.
    """
    source = None
    if sections is None:
        if name_or_path is None:
            raise ArpoError("load_experiment needs a file, a name or sections")
        source = resolve_experiment_path(name_or_path)
        sections = read_toml(source)
    where = str(source) if source else "experiment"
    sections = {k: dict(v) if isinstance(v, dict) else v for k, v in sections.items()}
    sections = apply_overrides(sections, overrides or [], SECTIONS)
    for section, body in sections.items():
        if section not in SECTIONS:
            raise unknown_key_error(section, SECTIONS, f"{where}: section [{section}]")
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: {section!r} must be a [section], got a plain key")
    if smoke.smoke():  # ARPO_SMOKE: one iteration, two prompts, short responses (arpo_algo.run.smoke)
        smoke.announce(f"experiment {where}")
        body = sections.setdefault("experiment", {})
        body["iterations"] = min(int(body.get("iterations", ExperimentConfig.iterations)), smoke.ITERATIONS)
    run = _run_settings(sections.get("experiment", {}), source, where)
    config = build_config(sections, run, where)
    if smoke.smoke():
        config.update_settings(smoke.experiment_budget(config.settings), f"{where} ({smoke.SMOKE_ENV})")
    return Experiment(run=run, config=config, sections=sections, source=source, overrides=list(overrides or []))


def _run_settings(body: dict[str, Any], source: Path | None, where: str) -> ExperimentConfig:
    values = {"name": source.stem if source else "experiment", **body}
    run = dataclass_from_dict(ExperimentConfig, values, f"{where}: [experiment]")
    run.validate(where)
    return run


def build_config(sections: dict[str, dict[str, Any]], run: ExperimentConfig, where: str) -> ARPOConfig:
    """The algorithm's config class with the file's settings sections applied (each key to exactly one field)."""
    config = CONFIG_CLASSES[run.algorithm]()
    config.debugging(seed=run.seed)
    if "path" not in sections.get("model", {}):
        check_keys(sections.get("model", {}), ["path"], f"{where}: [model]")
        raise ConfigError(f"{where}: [model] path is missing", hint='[model]\npath = "smollm2-135m-instruct"')
    env = dict(sections.get("env", {}))
    if "id" not in env:
        raise ConfigError(f"{where}: [env] id is missing", hint='[env]\nid = "arpo/ToolMath-v0"')
    env_id = env.pop("id")
    if not isinstance(env_id, str):
        raise ConfigError(f"{where}: [env] id must be a string, got {env_id!r}")
    _check_env_config(env_id, env, where)
    config.environment(env=env_id, env_config=env)
    config.update_settings({s: sections[s] for s in SETTING_SECTIONS if s in sections}, where)
    if "schedule_iterations" not in sections.get("training", {}):
        # A decaying schedule ends at the run's last optimizer step: the learner spans iterations x ppo_epochs x
        # mini_batches steps from this (an explicit total_steps wins), with the ppo_epochs and mini_batches it runs
        # with, so a sweep's trial that changes them keeps its own length.
        config.training(schedule_iterations=run.iterations)
    return config


def _check_env_config(env_id: str, env_config: dict[str, Any], where: str) -> None:
    """Unknown or invalid [env] keys fail at load time, naming the file (the env would reject them at build)."""
    import gymnasium as gym

    import arpo_env
    from arpo_env.core import resolve_config

    if env_id not in gym.registry:
        raise unknown_key_error(env_id, arpo_env.ENV_IDS, f"{where}: [env] id")
    try:
        resolve_config(env_config, **gym.spec(env_id).kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: [env] {e.message}", hint=e.hint) from e


def experiment_record(exp: Experiment) -> dict[str, Any]:
    """What config.json holds: the sections as resolved, the run settings and every ARPO setting by group."""
    cfg = exp.config
    return {
        "source": str(exp.source) if exp.source else None,
        "overrides": exp.overrides,
        "experiment": dataclasses.asdict(exp.run),
        "sections": exp.sections,
        "algorithm": type(cfg).__name__,
        "env": cfg.env if isinstance(cfg.env, str) else repr(cfg.env),
        "env_config": dict(cfg.env_config),
        "seed": cfg.seed,
        "settings": cfg.settings.sections(),
    }
