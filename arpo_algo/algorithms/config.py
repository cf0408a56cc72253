"""AgenticRLConfig: the one, strict source of configuration that ARPOConfig, AEPOConfig and GRPOConfig share.

RLlib and Tune require an :class:`~ray.rllib.algorithms.algorithm_config.AlgorithmConfig`, so that is where every
setting lives. The knobs come in four groups, each with its own setter:

* ``.training(...)``: the model and the learner. Every field of :class:`arpo_algo.train.learner.LearnerConfig`
  (``lr`` and ``grad_clip`` reuse RLlib's fields of the same name) plus ``model_path`` and ``prompts_per_step``.
* ``.tree(...)``: branching. Every field of :class:`arpo_algo.core.tree.TreeConfig` except ``mode``, which is the
  algorithm (ARPO, AEPO or GRPO: pick the config class).
* ``.llm_rollouts(...)``: sampling, engine and resources (:data:`arpo_algo.algorithms.options.ROLLOUT_OPTIONS`).
* ``.evaluation(...)``: RLlib's ``evaluation_interval`` plus the held-out protocol (``EVAL_OPTIONS``).

The environment is RLlib's standard ``.environment(env="arpo/ToolMath-v0", env_config={...})``. Strictness: unknown
keys are rejected in every setter and in :meth:`AgenticRLConfig.update_from_dict` (the path Tune uses, which RLlib
leaves permissive), naming the key and the closest valid name; wrong types are rejected;
:meth:`AgenticRLConfig.validate` explains illegal combinations.

Each algorithm family module (:mod:`.arpo`, :mod:`.aepo`, :mod:`.grpo`) holds its config class and its Algorithm
together, as RLlib does, so neither imports the other lazily.
"""

from __future__ import annotations

import functools
from typing import Any

from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.tune.result import STDERR_FILE, STDOUT_FILE, TRIAL_INFO

from arpo_algo.algorithms.options import (
    _GROUPS,
    _RLLIB_TRAINING_DICT_KEYS,
    ALL_OPTIONS,
    BACKEND_OPTIONS,
    LEARNER_OPTIONS,
    TREE_OPTIONS,
    _is_search_space,
    check_value,
    unknown_key_error,
)
from arpo_algo.core.tree import TreeConfig
from arpo_algo.train.backend_config import BackendConfig
from arpo_algo.train.learner import LearnerConfig
from arpo_base.errors import ConfigError
from arpo_base.options import closest


class AgenticRLConfig(AlgorithmConfig):
    """The settings ARPO, AEPO and GRPO share (use :class:`~arpo_algo.algorithms.arpo.ARPOConfig` and its siblings).

    """

    #: The tree sampler mode (TreeConfig.mode); set by the class, not by the user.
    variant: str = "arpo"
    #: Defaults that differ from the TreeConfig/LearnerConfig/own defaults for this variant.
    variant_defaults: dict[str, Any] = {}

    def __init__(self, algo_class: type | None = None) -> None:
        super().__init__(algo_class=algo_class)
        for name, opt in ALL_OPTIONS.items():
            setattr(self, name, opt.default)
        for name, value in self.variant_defaults.items():
            setattr(self, name, value)
        # No EnvRunnerGroup: our own rollout component plays the env (RAY_NOTES §1.1, the MARWIL switch).
        self._is_online = False
        self.seed = 0

    # ------------------------------------------------------------------------------------------------ setters

    def _set_group(self, group: str, kwargs: dict[str, Any]) -> None:
        options = _GROUPS[group]
        for key, value in kwargs.items():
            if key not in options:
                raise unknown_key_error(key, options, f"ARPOConfig.{group}()")
            setattr(self, key, check_value(key, value, f"ARPOConfig.{group}()"))

    def training(self, **kwargs: Any) -> AgenticRLConfig:  # type: ignore[override]
        """Model and learner settings: ``model_path``, ``prompts_per_step`` and every LearnerConfig field.

        RLlib's other training() arguments (gamma, train_batch_size, ...) have no effect on ARPO and are rejected.
        """
        self._set_group("training", kwargs)
        return self

    def tree(self, **kwargs: Any) -> AgenticRLConfig:
        """Branching settings: every :class:`arpo_algo.core.tree.TreeConfig` field except ``mode``."""
        self._set_group("tree", kwargs)
        return self

    def llm_rollouts(self, **kwargs: Any) -> AgenticRLConfig:
        """Sampling, engine and resource settings (:data:`ROLLOUT_OPTIONS`)."""
        self._set_group("llm_rollouts", kwargs)
        return self

    def evaluation(self, **kwargs: Any) -> AgenticRLConfig:  # type: ignore[override]
        """Held-out evaluation: RLlib's ``evaluation_interval`` (and other evaluation_* arguments) plus
        :data:`EVAL_OPTIONS`."""
        ours = {k: v for k, v in kwargs.items() if k in _GROUPS["evaluation"]}
        rest = {k: v for k, v in kwargs.items() if k not in ours}
        valid = set(_GROUPS["evaluation"]) | {"evaluation_interval"}
        for key in rest:
            if key != "evaluation_interval" and not key.startswith("evaluation_"):
                raise unknown_key_error(key, valid, "ARPOConfig.evaluation()")
        self._set_group("evaluation", ours)
        super().evaluation(**rest)
        return self

    # ------------------------------------------------------------------------------------------ dict path (Tune)

    @classmethod
    @functools.cache
    def _known_keys(cls) -> frozenset[str]:
        # Tune adds its own bookkeeping keys to every trial's config dict.
        tune_keys = {TRIAL_INFO, STDOUT_FILE, STDERR_FILE}
        return frozenset(vars(cls())) | tune_keys | {"multiagent", "_enable_new_api_stack"}

    def update_from_dict(self, config_dict: dict[str, Any]) -> AgenticRLConfig:  # type: ignore[override]
        """RLlib's update_from_dict, but unknown keys raise ConfigError (RLlib sets them silently, RAY_NOTES §1.4.7)."""
        known = type(self)._known_keys()
        for key in config_dict:
            translated = self._translate_special_keys(key, warn_deprecated=False)
            if translated not in known:
                near = closest(key, known)
                hint = f"did you mean {near!r}?" if near else (
                    f"ARPO settings: {', '.join(sorted(ALL_OPTIONS))} (plus RLlib's AlgorithmConfig fields)")
                raise ConfigError(f"{type(self).__name__} dict: unknown key {key!r}", hint=hint)
        rest = {}
        for key, value in config_dict.items():
            if key in ALL_OPTIONS:
                check_value(key, value, f"{type(self).__name__} dict")
            if key in _RLLIB_TRAINING_DICT_KEYS:
                # RLlib routes these through .training(), which ARPO keeps for its own settings; they have no effect
                # on ARPO, so they are stored as plain attributes (as RLlib's own training() would).
                setattr(self, key, value)
            else:
                rest[key] = value
        super().update_from_dict(rest)
        return self

    # ------------------------------------------------------------------------------------------------ views

    def tree_config(self) -> TreeConfig:
        """The TreeConfig these settings describe (``mode`` = this config's variant)."""
        return TreeConfig(mode=self.variant, **{k: getattr(self, k) for k in TREE_OPTIONS})

    def learner_config(self) -> LearnerConfig:
        """The LearnerConfig these settings describe."""
        return LearnerConfig(**{k: getattr(self, k) for k in LEARNER_OPTIONS})

    def backend_config(self) -> BackendConfig:
        """Where the learner runs (``learner_backend``, ``learner_workers``, ...)."""
        return BackendConfig(**{k: getattr(self, k) for k in BACKEND_OPTIONS})

    def arpo_settings(self) -> dict[str, Any]:
        """Every ARPO-specific setting by group (what experiment files and config.json show)."""
        return {g: {k: getattr(self, k) for k in opts} for g, opts in _GROUPS.items()}

    # ------------------------------------------------------------------------------------------------ validate

    def validate(self) -> None:
        """RLlib's checks first, then types of every ARPO field, then the combinations, each explained."""
        super().validate()
        for name in ALL_OPTIONS:
            value = getattr(self, name)
            if _is_search_space(value):
                raise ConfigError(f"{name} is still a Tune search space ({value!r})",
                                  hint="pass the config to tune.Tuner(param_space=...) instead of building it")
            coerced = check_value(name, value)
            if type(coerced) is not type(value) and not self._is_frozen:
                setattr(self, name, coerced)  # e.g. an int learning rate from a dict becomes a float
        self._validate_combinations()
        self.tree_config().validate()
        self.learner_config().validate()
        backend = self.backend_config()
        backend.validate()
        backend.check_device(self.device)

    def _validate_decode(self) -> None:
        if self.engine != "hf" and (self.decode != "auto" or self.static_cache_tokens is not None):
            raise ConfigError(f"decode={self.decode!r} / static_cache_tokens={self.static_cache_tokens!r} apply to "
                              f"engine='hf' only, not engine={self.engine!r}",
                              hint="leave decode='auto' and static_cache_tokens unset with vLLM")
        if self.decode == "cuda_graph" and self.device != "cuda":
            raise ConfigError(f"decode='cuda_graph' needs device='cuda', got device={self.device!r}",
                              hint="decode='static' runs the same fixed-shape steps eagerly on CPU; 'auto' picks")
        if self.decode == "cuda_graph" and self.linear_layout == "transposed":
            raise ConfigError("decode='cuda_graph' with linear_layout='transposed': graphs would read weight copies "
                              "that are rebuilt after every update", hint="linear_layout='auto' or 'native'")
        if self.static_cache_tokens is not None and self.static_cache_tokens < 2:
            raise ConfigError(f"static_cache_tokens must be >= 2 or None, got {self.static_cache_tokens}")

    def _validate_combinations(self) -> None:
        if self.model_path is None:
            raise ConfigError("model_path is not set",
                              hint="config.training(model_path=<HF folder or registered name>)")
        if self.env is None:
            raise ConfigError("no environment set", hint='config.environment("arpo/ToolMath-v0", env_config={...})')
        positive = ("prompts_per_step", "max_batch_size", "max_response_tokens", "tool_workers", "eval_samples")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_rollout_actors < 0:
            raise ConfigError(f"num_rollout_actors must be >= 0, got {self.num_rollout_actors}")
        if self.num_cpus_per_rollout_actor <= 0:
            raise ConfigError("num_cpus_per_rollout_actor must be > 0")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0 for training rollouts, got {self.temperature}",
                              hint="policy-gradient needs sampled trajectories; greedy decoding is for evaluation")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.eval_temperature < 0:
            raise ConfigError(f"eval_temperature must be >= 0, got {self.eval_temperature}")
        if self.eval_temperature == 0 and self.eval_samples > 1:
            raise ConfigError(f"eval_samples={self.eval_samples} with greedy decoding (eval_temperature=0) "
                              "scores the same answer several times",
                              hint="set eval_temperature > 0 or eval_samples = 1")
        if self.eval_num_prompts is not None and self.eval_num_prompts < 1:
            raise ConfigError("eval_num_prompts must be >= 1 or None (all)")
        self._validate_decode()
        if self.engine == "vllm" and self.entropy_method != "topk_sum_lnV":
            raise ConfigError(f"engine='vllm' with entropy_method={self.entropy_method!r}: vLLM returns only top-k "
                              "logprobs, so the full entropy is not available",
                              hint="tree(entropy_method='topk_sum_lnV') (the reference estimator), or engine='hf'")
        if self.engine == "hf" and self.dtype != "float32" and self.num_rollout_actors == 0:
            raise ConfigError(f"dtype={self.dtype!r} with in-process rollouts: the in-process engine shares the "
                              "learner's float32 module, so it cannot run in another dtype",
                              hint="keep dtype='float32' (training(precision=...) sets the learner's compute "
                                   "precision), or use rollout actors (num_rollout_actors > 0), which hold their own copy")
        if self.num_learners > 0:
            raise ConfigError("num_learners > 0 is not supported: ARPO owns its learner in the main process",
                              hint="leave num_learners at 0; use device='cuda' for a GPU learner")
