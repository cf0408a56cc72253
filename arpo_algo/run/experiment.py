"""Experiment files: one strict TOML format that maps every key to exactly one setting.

An experiment file (``experiments/<name>.toml``) has these sections, all optional except ``[model]`` and ``[env]``::

    [experiment]   name, algorithm ("arpo" | "aepo" | "grpo"), seed, iterations, output, checkpoint_every,
                   keep_checkpoints, description                                      -> :class:`RunSettings`
    [model]        path                                                               -> ARPOConfig.model_path
    [env]          id (a registered env id); every other key goes to env_config       -> .environment(...)
    [tree]         TreeConfig fields except mode                                      -> .tree(...)
    [training]     LearnerConfig fields, prompts_per_step                             -> .training(...)
    [rollouts]     sampling/engine/resources (arpo_algo.algorithms.config.ROLLOUT_OPTIONS)       -> .llm_rollouts(...)
    [evaluation]   every (-> evaluation_interval), split, num_prompts, samples, temperature,
                   max_response_tokens (-> eval_*)                                    -> .evaluation(...)

Unknown sections and keys are errors naming the file, the section and the closest valid key; wrong types are errors
naming the key (all through :mod:`arpo_base.options`). ``env_config`` keys are checked by the environment's own config.
Overrides (``--set section.key=value``) use the same names and are parsed as TOML values
(:func:`arpo_base.options.parse_override`, the parser every command uses).

``[training] total_steps`` (the length of a decaying learning-rate schedule) defaults to ``iterations * ppo_epochs``,
the number of optimizer steps of the run. Bare experiment names are looked up in :func:`experiment_dirs`:
``$ARPO_EXPERIMENTS``, ``./experiments``, then the source checkout's ``experiments/``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo_algo.algorithms import CONFIG_CLASSES, ARPOConfig
from arpo_algo.algorithms.options import _GROUPS, check_value
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

__all__ = ["SECTIONS", "Experiment", "RunSettings", "build_config", "experiment_dirs", "experiment_record",
           "load_experiment", "resolve_experiment_path"]

#: The source checkout's experiments/ folder (None in a wheel install, which has no checkout).
_CHECKOUT = source_checkout(Path(__file__).resolve().parents[1])
EXPERIMENTS_DIR: Path | None = _CHECKOUT / "experiments" if _CHECKOUT else None
#: Environment variable with extra folders (os.pathsep-separated) searched for experiment names first.
EXPERIMENTS_ENV = "ARPO_EXPERIMENTS"

SECTIONS = ("experiment", "model", "env", "tree", "training", "rollouts", "evaluation")
_EVAL_KEYS = {"every": "evaluation_interval", **{k[len("eval_"):]: k for k in _GROUPS["evaluation"]}}


@dataclass
class RunSettings:
    """The ``[experiment]`` section: how ``arpo train`` drives the algorithm (not part of ARPOConfig).

    Attributes:
        name: Run name (default: the file's stem); also the default output folder ``runs/<name>``.
        algorithm: "arpo", "aepo" or "grpo": picks ARPOConfig, AEPOConfig or GRPOConfig.
        seed: Seed of everything (data order, sampling, branch draws, learner RNG).
        iterations: Training iterations (one iteration = prompts_per_step prompts sampled and one update).
        output: Run folder: config.json, metrics.jsonl, tb/, checkpoints/, learning_curve.png.
        checkpoint_every: Save a checkpoint every N iterations (the last iteration is always saved).
        keep_checkpoints: Keep only the newest N checkpoints in ``<output>/checkpoints``.
        description: Free text, shown in config.json.
    """

    name: str = "experiment"
    algorithm: str = "arpo"
    seed: int = 0
    iterations: int = 10
    output: str | None = None
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    description: str = ""

    def validate(self, where: str) -> None:
        """Range checks with the file name in the message."""
        check_choice("algorithm", self.algorithm, tuple(CONFIG_CLASSES), f"{where}: [experiment]")
        for name in ("iterations", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}: [experiment] {name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"{where}: [experiment] checkpoint_every must be >= 0 (0 = only at the end)")


@dataclass
class Experiment:
    """A loaded experiment: run settings, the algorithm config, and the sections it came from (after overrides)."""

    run: RunSettings
    config: ARPOConfig
    sections: dict[str, dict[str, Any]]
    source: Path | None = None
    overrides: list[str] = field(default_factory=list)

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output or f"runs/{self.run.name}").expanduser()


def experiment_dirs() -> list[Path]:
    """Where bare experiment names are looked up, in order: the folders in ``$ARPO_EXPERIMENTS``, ``./experiments``
    (the working directory's), and the source checkout's ``experiments/`` (when arpo runs from a checkout)."""
    dirs = [Path(d).expanduser() for d in os.environ.get(EXPERIMENTS_ENV, "").split(os.pathsep) if d]
    dirs.append(Path.cwd() / "experiments")
    if EXPERIMENTS_DIR is not None:
        dirs.append(EXPERIMENTS_DIR)
    unique: dict[Path, Path] = {}
    for d in dirs:
        unique.setdefault(d.resolve(), d)
    return list(unique.values())


def resolve_experiment_path(name_or_path: str | Path) -> Path:
    """A path to an existing file, or a bare name looked up as ``<dir>/<name>.toml`` in :func:`experiment_dirs`."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    dirs = experiment_dirs()
    for d in dirs:
        for cand in (d / f"{name_or_path}.toml", d / str(name_or_path)):
            if cand.is_file():
                return cand
    known = sorted({f.stem for d in dirs if d.is_dir() for f in d.glob("*.toml")})
    searched = ", ".join(str(d) for d in dirs)
    hint = f"known experiments: {', '.join(known)}" if known else (
        f"no experiment files found; pass a path to a .toml file, or set {EXPERIMENTS_ENV} to a folder holding them "
        "(the repository's experiments/ folder has examples)")
    raise ArpoError(f"experiment {str(name_or_path)!r} not found: neither a file nor <name>.toml in {searched}",
                    hint=hint)


def load_experiment(name_or_path: str | Path | None = None, overrides: list[str] | None = None, *,
                    sections: dict[str, dict[str, Any]] | None = None) -> Experiment:
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
    run = _run_settings(sections.get("experiment", {}), source, where)
    config = build_config(sections, run, where)
    return Experiment(run=run, config=config, sections=sections, source=source, overrides=list(overrides or []))


def _run_settings(body: dict[str, Any], source: Path | None, where: str) -> RunSettings:
    values = {"name": source.stem if source else "experiment", **body}
    run = dataclass_from_dict(RunSettings, values, f"{where}: [experiment]")
    run.validate(where)
    return run


def build_config(sections: dict[str, dict[str, Any]], run: RunSettings, where: str) -> ARPOConfig:
    """Map the sections onto the algorithm's config class (every key to exactly one field)."""
    config = CONFIG_CLASSES[run.algorithm]()
    config.debugging(seed=run.seed)
    model = sections.get("model", {})
    check_keys(model, ["path"], f"{where}: [model]")
    if "path" not in model:
        raise ConfigError(f"{where}: [model] path is missing", hint='[model]\npath = "smollm2-135m-instruct"')
    env = dict(sections.get("env", {}))
    if "id" not in env:
        raise ConfigError(f"{where}: [env] id is missing", hint='[env]\nid = "arpo/ToolMath-v0"')
    env_id = env.pop("id")
    if not isinstance(env_id, str):
        raise ConfigError(f"{where}: [env] id must be a string, got {env_id!r}")
    _check_env_config(env_id, env, where)
    config.environment(env=env_id, env_config=env)
    mapping = {"tree": ("tree", config.tree), "training": ("training", config.training),
               "rollouts": ("llm_rollouts", config.llm_rollouts)}
    try:
        config.training(model_path=check_value("model_path", model["path"], f"{where}: [model] path"))
        for section, (group, setter) in mapping.items():
            body = sections.get(section, {})
            check_keys(body, set(_GROUPS[group]) - {"model_path"}, f"{where}: [{section}]")
            setter(**body)
        if "total_steps" not in sections.get("training", {}):
            # One iteration = one learner update = ppo_epochs optimizer steps, so a decaying schedule ends at the
            # run's last update (the LearnerConfig default None would refuse it).
            config.training(total_steps=run.iterations * config.ppo_epochs)
        evaluation = sections.get("evaluation", {})
        check_keys(evaluation, _EVAL_KEYS, f"{where}: [evaluation]")
        if "every" in evaluation and (isinstance(evaluation["every"], bool)
                                      or not isinstance(evaluation["every"], int) or evaluation["every"] < 0):
            raise ConfigError(f"{where}: [evaluation] every must be an int >= 0, got {evaluation['every']!r}")
        config.evaluation(**{_EVAL_KEYS[k]: v for k, v in evaluation.items()})
    except ConfigError as e:
        if e.message.startswith(where):
            raise
        raise ConfigError(f"{where}: {e.message}", hint=e.hint) from e
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
        "evaluation_interval": cfg.evaluation_interval,
        "seed": cfg.seed,
        "settings": cfg.arpo_settings(),
    }
