"""AgenticRLConfig: the RLlib config every algorithm variant shares (ARPOConfig and its subclasses).

RLlib and Tune require an :class:`~ray.rllib.algorithms.algorithm_config.AlgorithmConfig`. Ours holds one object,
``config.settings`` (:class:`arpo_algo.algorithms.settings.Settings`): one dataclass per experiment-file section, each
validated where it is defined, handed to the sampler, learner and engines as it is. Three ways in, one name each:

* setters, one per section: ``.training(lr=1e-5)``, ``.tree(tau=0.5)``, ``.backend(learner_backend="ddp")``,
  ``.llm_rollouts(max_response_tokens=256, hf={"decode": "static"})``, ``.evaluation(every=5, num_prompts=50)``;
* dotted names: ``.update_settings({"tree.tau": 0.5, "rollouts.hf.decode": "static"})`` (what ``--set`` and sweep
  files write);
* the RLlib dict (Tune's path): :meth:`to_dict` gives every setting under its dotted name and
  :meth:`update_from_dict` reads them back, so ``param_space["tree.tau"] = tune.uniform(0.2, 1.0)`` sweeps it.

The environment is RLlib's own ``.environment(env="arpo/ToolMath-v0", env_config={...})``. Unknown keys are rejected
everywhere (RLlib's dict path would set them silently), naming the closest valid one. RLlib's own fields that arpo
does not read are refused at validation once set away from RLlib's default (:mod:`arpo_algo.algorithms.rllib_fields`
names arpo's equivalent of each).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.tune.result import STDERR_FILE, STDOUT_FILE, TRIAL_INFO

from arpo_algo.algorithms.rllib_fields import check_callbacks, check_unused_fields, same_value
from arpo_algo.algorithms.settings import Settings, check_records
from arpo_algo.algorithms.variants import algorithm_of, preset_of
from arpo_algo.core.tree import TreeConfig
from arpo_base.errors import ConfigError
from arpo_base.options import closest

#: RLlib attributes that ARPO replaces by its own settings: a dict or call that sets them is refused, not ignored.
_REPLACED_RLLIB = {"lr": "training.lr", "grad_clip": "training.grad_clip", "evaluation_interval": "evaluation.every"}
#: RLlib fields :meth:`AgenticRLConfig.to_dict` always writes: what a trial's environment is.
_ALWAYS_IN_DICT = ("env", "env_config")
#: Keys RLlib's update_from_dict routes through .training(); they have no effect on ARPO (see update_from_dict).
_RLLIB_TRAINING_DICT_KEYS = ("model", "optimizer", "replay_buffer_config")


def _is_search_space(value: Any) -> bool:
    """Tune search-space objects may sit in a config dict until Tune resolves them."""
    from ray.tune.search.sample import Domain

    return isinstance(value, Domain) or (isinstance(value, dict) and set(value) == {"grid_search"})


class AgenticRLConfig(AlgorithmConfig):
    """The settings every variant shares (use :class:`~arpo_algo.algorithms.arpo.ARPOConfig` and its subclasses)."""

    #: The ``[experiment] algorithm`` name (:func:`arpo_algo.algorithms.variants.register_variant`).
    variant: str = "arpo"
    #: The tree sampler family it runs (``tree.mode``); set by the class, not by the user.
    tree_mode: str = "arpo"
    #: Its defaults that differ from its base class's, by dotted name (the bases' presets apply first).
    preset: dict[str, Any] = {}
    #: What it changes from ARPO, by dotted setting name, each with the paper's section (docs and the reference).
    changes: dict[str, str] = {}
    #: The Algorithm it builds, where it is not the one ``register_variant`` tied to it (:func:`algorithm_of`).
    algorithm_class: type | None = None

    def __init__(self, algo_class: type | None = None) -> None:
        super().__init__(algo_class=algo_class or type(self).algorithm_class or algorithm_of(type(self)))
        self.settings = type(self).default_settings()
        # No EnvRunnerGroup: our own rollout component plays the env (the offline switch RLlib's MARWIL uses).
        self._is_online = False
        self.seed = 0

    @classmethod
    def default_settings(cls) -> Settings:
        """This variant's defaults: every section's own, with its tree mode and the presets of its classes."""
        return Settings(tree=TreeConfig(mode=cls.tree_mode)).update(preset_of(cls), f"{cls.__name__} preset")

    # ------------------------------------------------------------------------------------------------ setters

    def update_settings(self, values: Mapping[str, Any], where: str | None = None) -> AgenticRLConfig:
        """Apply settings by dotted name (``{"tree.tau": 0.5}``) or section table (``{"tree": {"tau": 0.5}}``)."""
        self.settings = self.settings.update(values, where or type(self).__name__, placeholder=_is_search_space)
        self.evaluation_interval = self.settings.evaluation.every or None
        return self

    def _section(self, section: str, kwargs: dict[str, Any]) -> AgenticRLConfig:
        return self.update_settings({section: kwargs}, f"{type(self).__name__}.{section}()")

    def training(self, **kwargs: Any) -> AgenticRLConfig:  # type: ignore[override]
        """``[training]``: every :class:`~arpo_algo.train.learner_config.TrainingConfig` field, plus ``model_path``
        (``model.path``). RLlib's other training() arguments (gamma, train_batch_size, ...) are rejected."""
        if "model_path" in kwargs:
            self.update_settings({"model.path": kwargs.pop("model_path")}, f"{type(self).__name__}.training()")
        return self._section("training", kwargs)

    def tree(self, **kwargs: Any) -> AgenticRLConfig:
        """``[tree]``: every :class:`arpo_algo.core.tree.TreeConfig` field except ``mode`` (the algorithm)."""
        return self._section("tree", kwargs)

    def backend(self, **kwargs: Any) -> AgenticRLConfig:
        """``[backend]``: where the learner runs (:class:`arpo_algo.train.backend_config.BackendConfig`)."""
        return self._section("backend", kwargs)

    def llm_rollouts(self, **kwargs: Any) -> AgenticRLConfig:
        """``[rollouts]``: :class:`arpo_algo.rollout.config.RolloutsConfig`; ``hf={...}`` / ``vllm={...}`` set the
        engine sub-tables."""
        return self._section("rollouts", kwargs)

    def evaluation(self, **kwargs: Any) -> AgenticRLConfig:  # type: ignore[override]
        """``[evaluation]``: :class:`arpo_algo.eval.config.EvaluationConfig` (``every`` is RLlib's
        ``evaluation_interval``, accepted under either name); RLlib's other ``evaluation_*`` arguments are stored and
        refused by :meth:`validate`, which names arpo's equivalent."""
        if "evaluation_interval" in kwargs:
            kwargs["every"] = kwargs.pop("evaluation_interval") or 0
        rllib = {k: v for k, v in kwargs.items() if k.startswith("evaluation_")}
        ours = {k: v for k, v in kwargs.items() if k not in rllib}
        self._section("evaluation", ours)
        super().evaluation(**rllib)
        return self

    # ------------------------------------------------------------------------------------------ dict path (Tune)

    def to_dict(self) -> dict[str, Any]:
        """Every ARPO setting under its dotted name (``"tree.tau"``), so Tune search spaces are placed by the same
        names as ``--set``, plus the environment and the RLlib fields set away from this class's defaults: a trial's
        ``params.json`` holds the run's settings, not RLlib's hundreds of inert ones (:meth:`update_from_dict` starts
        from the defaults, so what is left out reads back as it was)."""
        defaults = type(self)._rllib_defaults()
        out = {
            k: v for k, v in self._rllib_dict().items() if k in _ALWAYS_IN_DICT or not same_value(v, defaults.get(k))
        }
        out.update(self.settings.flat())
        return out

    def _rllib_dict(self) -> dict[str, Any]:
        """RLlib's whole dict, without ARPO's settings object and the RLlib fields it replaces."""
        out = super().to_dict()
        out.pop("settings", None)
        for key in _REPLACED_RLLIB:
            out.pop(key, None)
        return out

    @classmethod
    @functools.cache
    def _rllib_defaults(cls) -> dict[str, Any]:
        return cls()._rllib_dict()

    @classmethod
    @functools.cache
    def _known_keys(cls) -> frozenset[str]:
        # Tune adds its own bookkeeping keys to every trial's config dict.
        tune_keys = {TRIAL_INFO, STDOUT_FILE, STDERR_FILE}
        return (
            frozenset(cls()._rllib_dict())
            | frozenset(cls().settings.flat())
            | tune_keys
            | {"multiagent", "_enable_new_api_stack"}
        )

    def update_from_dict(self, config_dict: dict[str, Any]) -> AgenticRLConfig:  # type: ignore[override]
        """RLlib's update_from_dict, but unknown keys raise ConfigError (RLlib sets them silently) and ARPO settings
        go by their dotted names."""
        known = type(self)._known_keys()
        where = f"{type(self).__name__} dict"
        ours, rest = {}, {}
        for key, value in config_dict.items():
            if key in _REPLACED_RLLIB:
                new = _REPLACED_RLLIB[key]
                raise ConfigError(
                    f"{where}: {key!r} is RLlib's; ARPO's setting is {new!r}", hint=f"use the dotted name {new}"
                )
            if "." in key:
                ours[key] = value
            elif key not in known and self._translate_special_keys(key, warn_deprecated=False) not in known:
                near = closest(key, known)
                raise ConfigError(
                    f"{where}: unknown key {key!r}",
                    hint=f"did you mean {near!r}?"
                    if near
                    else "ARPO settings are dotted names such as 'tree.tau' (ARPOConfig().to_dict() lists them all)",
                )
            elif key in _RLLIB_TRAINING_DICT_KEYS:
                # RLlib routes these through .training(), which ARPO keeps for its own settings; they have no effect
                # on ARPO, so they are stored as plain attributes (as RLlib's own training() would).
                setattr(self, key, value)
            else:
                rest[key] = value
        if ours:
            self.update_settings(ours, where)
        super().update_from_dict(rest)
        return self

    # ------------------------------------------------------------------------------------------------ validate

    def validate(self) -> None:
        """RLlib's checks first, then every section's own checks and those across sections, each explained."""
        where = type(self).__name__
        check_unused_fields(self, where)  # before RLlib's checks, whose errors would name RLlib's machinery
        check_callbacks(self.callbacks_class, where)
        super().validate()
        if self.env is None:
            raise ConfigError("no environment set", hint='config.environment("arpo/ToolMath-v0", env_config={...})')
        for key, value in self.settings.flat().items():
            if _is_search_space(value):
                raise ConfigError(
                    f"{key} is still a Tune search space ({value!r})",
                    hint="pass the config to tune.Tuner(param_space=...) instead of building it",
                )
        if (self.evaluation_interval or 0) != self.settings.evaluation.every:
            raise ConfigError(
                f"evaluation_interval={self.evaluation_interval!r} disagrees with evaluation.every="
                f"{self.settings.evaluation.every}",
                hint="set it with .evaluation(every=N)",
            )
        check_records(self.settings, type(self).default_settings())
        self.settings.validate()

    def _validate_new_api_stack_settings(self) -> None:
        """RLlib's check of its API-stack flags, which also logs its "new API stack" banner on every build: arpo runs
        neither stack (its own learner and sampler), and a change to either flag is refused by
        :func:`~arpo_algo.algorithms.rllib_fields.check_unused_fields`, so there is nothing to check or announce."""
