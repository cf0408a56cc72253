"""ARPO and its variants as thin RLlib Algorithms (docs/howto/rllib.md#a-thin-algorithm).

The algorithm owns its policy (a learner backend of :mod:`arpo_algo.train.backends`: "local" =
:class:`arpo_algo.train.learner.Learner` in this process, or "ddp"/"deepspeed" ranks in Ray actors) and its
rollout component (:class:`arpo_algo.rollout.sampler.TreeSampler` over an in-process
:class:`arpo_algo.rollout.engines.hf.engine.HFEngine` that shares the learner's module, or over a
:class:`arpo_algo.rollout.engines.actors.RolloutActorPool`). RLlib provides the config, the metrics logger, Tune
integration and checkpoints; no EnvRunners, RLModules or LearnerGroups are built.

One iteration (:meth:`AgenticRLAlgorithm.training_step`, five numbered steps): sync weights -> sample one group per
prompt (rewards come from the environment's final step) -> advantages and update (inside the learner) -> record.

Checkpoints (``save_to_path`` / ``restore_from_path`` / ``from_checkpoint`` / Tune's save and restore) hold data
only (:mod:`arpo_algo.algorithms.checkpoint`)::

    ckpt/ arpo_checkpoint.json   (format, version, algorithm, iteration, data position, metrics, settings: JSON)
          policy/  model.safetensors config.json tokenizer* chat_template.jinja generation_config.json   (plain HF)
                   trainer_state.pt   (optimizer, scheduler, RNG, learner step: tensors and plain values)

``policy/`` loads with ``AutoModelForCausalLM.from_pretrained`` and in vLLM directly. Reading a checkpoint unpickles
nothing but tensors; any other layout is refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from typing import TYPE_CHECKING, Any

from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.utils.checkpoints import Checkpointable
from ray.tune.execution.placement_groups import PlacementGroupFactory

from arpo_algo import __version__
from arpo_algo.algorithms.checkpoint import (
    CHECKPOINT_FORMAT,
    POLICY_DIR,
    config_from_state,
    read_checkpoint_state,
    restore_checkpoint,
    write_checkpoint,
)
from arpo_algo.algorithms.components import (
    PolicyComponent,
    PromptIterator,
    _as_list,
    check_resources_feasible,
    env_creator,
    resource_bundles,
)
from arpo_algo.algorithms.config import AgenticRLConfig
from arpo_algo.algorithms.stabilizers import sample_groups
from arpo_algo.models.policy_env import served_defaults
from arpo_algo.rollout import learner_metrics as LK
from arpo_algo.rollout import metrics as MK
from arpo_algo.rollout.diagnostics import group_diagnostics
from arpo_algo.rollout.records import record_source
from arpo_base.errors import ArpoError, ConfigError

if TYPE_CHECKING:
    from arpo_algo.eval.trees import TreeWriter
    from arpo_algo.rollout.engines.base import RolloutEngine
    from arpo_algo.rollout.sampler import TreeSampler


def _algorithm_class(base: type, name: str) -> type:
    """``base`` or the subclass of AgenticRLAlgorithm called ``name`` (a checkpoint names its algorithm)."""
    found = [c for c in (base, *_subclasses(AgenticRLAlgorithm)) if c.__name__ == name]
    if not found:
        raise ArpoError(f"the checkpoint was written by an unknown algorithm {name!r}")
    return found[0]


def _subclasses(cls: type) -> list[type]:
    return [s for c in cls.__subclasses__() for s in (c, *_subclasses(c))]


def _learner_ranks(cfg: AgenticRLConfig) -> int:
    backend = cfg.settings.backend
    return backend.learner_workers if backend.distributed else 0


def _check_main_placement(main_resources: dict[str, float]) -> None:
    """backend.main_resources places the process a Tune trial runs in; in the driver (not a Ray actor) nothing can
    move the process, so the setting would be silently ignored: refused instead."""
    import ray

    if main_resources and not (ray.is_initialized() and ray.get_runtime_context().get_actor_id()):
        raise ConfigError(
            f"backend.main_resources = {main_resources} places a Tune trial's process, but this "
            "Algorithm runs in the driver, which stays on the node where it was started",
            hint="start the run on the node you want it on and leave main_resources empty, or run "
            "it as a trial of arpo tune",
        )


class AgenticRLAlgorithm(Algorithm):
    """What every variant shares: a thin RLlib Algorithm (see the module docstring)."""

    #: The config class it is built from (set by :func:`~arpo_algo.algorithms.variants.register_variant`).
    config_class: type[AgenticRLConfig] = AgenticRLConfig

    @classmethod
    def get_default_config(cls) -> AgenticRLConfig:
        return cls.config_class(algo_class=cls)

    @classmethod
    def default_resource_request(cls, config: AlgorithmConfig | dict) -> PlacementGroupFactory:
        """What Tune reserves per trial: the learner process plus every rollout actor; infeasible -> ConfigError."""
        cfg = config if isinstance(config, AgenticRLConfig) else cls.get_default_config().update_from_dict(dict(config))
        bundles = resource_bundles(cfg)
        check_resources_feasible(bundles, _learner_ranks(cfg))
        return PlacementGroupFactory(bundles, strategy=cfg.placement_strategy)

    # ---------------------------------------------------------------------------------------------------- setup

    def setup(self, config: AgenticRLConfig) -> None:
        """Build learner, engine and sampler.

        Not ``super().setup()``: with ``_is_online=False`` and no RLModule spec, RLlib 2.60's setup still builds a
        LearnerGroup from the env's spaces and fails (``observation_space not provided``,
        docs/howto/rllib.md#what-the-base-class-assumes); our
        learner, engine and sampler replace the EnvRunners and the LearnerGroup. So only what ``step()``/``save()``
        read is set up here: the callbacks, ``env_runner_group`` (``None``: nothing to sync or restore) and the
        metrics timers (docs/howto/rllib.md#metrics-without-super-setup).
        """
        from arpo_algo.models import resolve_model_path
        from arpo_algo.train.backends import build_backend

        self.callbacks = [c() for c in _as_list(self.config.callbacks_class)]
        self.env_runner_group = None
        self._set_up_metrics()
        cfg = self.config
        settings = cfg.settings
        _check_main_placement(settings.backend.main_resources)
        check_resources_feasible(resource_bundles(cfg), _learner_ranks(cfg))
        model_path = resolve_model_path(settings.model.path)
        if settings.backend.distributed:
            self._ensure_ray()
        # The mismatch alarm's levels follow the sampler's dtype as well as the learner's precision.
        training = settings.training.for_sampler(settings.rollouts.dtype, settings.rollouts.device)
        self.learner = build_backend(
            model_path,
            training,
            settings.backend,
            device=settings.rollouts.device,
            seed=cfg.seed,
            lora=settings.model.lora,
        )
        self.policy = PolicyComponent(self.learner)
        self.tree_config = settings.tree
        self._train_env = env_creator(cfg)
        self._eval_env = env_creator(cfg, split=settings.evaluation.split)
        env = self._train_env()
        self.prompts = PromptIterator(env.num_tasks, cfg.seed)
        self.records = record_source(settings, self.learner.tokenizer)
        if self.records is None and settings.training.prompts_per_step > env.num_tasks:  # a step draws distinct tasks
            raise ConfigError(
                f"training.prompts_per_step = {settings.training.prompts_per_step} exceeds the "
                f"{env.num_tasks} tasks of the training split",
                hint="lower training.prompts_per_step",
            )
        # what every policy folder this run writes records for serving (the env it was trained in decides them)
        self.served_defaults = served_defaults(env)
        self.engine = self._build_engine(model_path)
        self.sampler = self._build_sampler()
        self.tree_writer = self._build_tree_writer()
        self.rollout_pipeline = None
        if settings.rollouts.asynchronous:
            from arpo_algo.algorithms.pipeline import RolloutPipeline

            self.rollout_pipeline = RolloutPipeline(self._sample, settings.rollouts.max_staleness)
        self._last_eval: dict[str, float] = {}
        self._callback("on_algorithm_init", algorithm=self)

    def _callback(self, name: str, **kwargs: Any) -> None:
        """Fire RLlib callback ``name`` on the callbacks objects and the config's ``callbacks_on_*`` functions, as
        RLlib's own Algorithm does (docs/howto/rllib.md#callbacks lists the ones arpo fires)."""
        from ray.rllib.callbacks.utils import make_callback

        functions = getattr(self.config, f"callbacks_{name}", None)
        make_callback(name, self.callbacks, functions, kwargs=dict(kwargs, metrics_logger=self.metrics))

    def _build_engine(self, model_path: pathlib.Path) -> RolloutEngine:
        """The configured engine (:func:`arpo_algo.rollout.engines.build_engine`): in-process HF shares the learner's
        module; vLLM or actors hold their own copy and get weights pushed in :meth:`_sync_weights`."""
        from arpo_algo.rollout.engines import build_engine

        cfg = self.config
        rollouts = cfg.settings.rollouts
        spec = rollouts.engine_spec
        # an engine without full entropies (vLLM) has only the top-k estimator, which a sampled run's tree asks for
        # by name (Settings.validate) and a records run, which grows no tree, takes as it is
        topk = self.tree_config.entropy_method == "topk_sum_lnV" or not spec.capabilities.full_entropy
        own = rollouts.engine_config
        settings: dict[str, Any] = dict(
            own.engine_kwargs() if own is not None else {},
            entropy_method="topk_sum_lnV" if topk else "full",
            seed=cfg.seed,
            dtype=rollouts.dtype,
        )
        if spec.capabilities.shares_module and not self._engine_owns_weights():
            return build_engine(
                spec.name, model=self.learner.shared_module, tokenizer=self.learner.tokenizer, **settings
            )
        if "device" in spec.keywords():  # an engine that places itself (vLLM) takes no device
            settings["device"] = rollouts.device
        lora = cfg.settings.model.lora
        if lora.enabled:  # its own copy (HF) or vLLM's LoRA request: the learner's layout, filled by adapter syncs
            settings["lora"] = dataclasses.replace(lora, target_modules=tuple(self.learner.lora_targets))
        if rollouts.num_rollout_actors > 0:
            self._ensure_ray()
        return build_engine(
            rollouts.engine,
            model_or_path=str(model_path),
            num_actors=rollouts.num_rollout_actors,
            num_cpus_per_actor=rollouts.num_cpus_per_rollout_actor,
            actor_resources=rollouts.actor_resources,
            **settings,
        )

    def _ensure_ray(self) -> None:
        """Start Ray sized to this config unless it runs (started here, so stopped by cleanup(); a Tune trial finds
        Ray running)."""
        import ray

        if not ray.is_initialized():
            from arpo_base.ray_start import init_ray, ray_address

            # RAY_ADDRESS: that cluster; else a Ray of its own, never the one a stale ray_current_cluster file names
            sized = {} if ray_address() else {"num_cpus": int(sum(b["CPU"] for b in resource_bundles(self.config)))}
            init_ray(include_dashboard=False, **sized)
            self._owns_ray = True

    def _engine_owns_weights(self) -> bool:
        """False only for an in-process engine that can share the learner's module (HF) over a learner module in this
        process ("local" backend): it shares that module (nothing to push). With ddp/deepspeed the in-process engine
        holds its own copy."""
        rollouts = self.config.settings.rollouts
        return (
            not rollouts.engine_spec.capabilities.shares_module
            or rollouts.num_rollout_actors > 0
            or self.learner.shared_module is None
        )

    def _build_sampler(self) -> TreeSampler:
        from arpo_algo.rollout.sampler import TreeSampler

        rollouts = self.config.settings.rollouts
        return TreeSampler.from_config(self.engine, self._train_env, self.tree_config, rollouts, seed=self.config.seed)

    def _build_tree_writer(self) -> TreeWriter | None:
        """The one writer of rollout trees (:mod:`arpo_algo.eval.trees`), or None when recording is off."""
        from arpo_algo.eval.trees import FOLDER, TreeWriter

        rollouts = self.config.settings.rollouts
        run_folder = self._run_folder()
        folder = rollouts.record_path or (os.path.join(run_folder, FOLDER) if run_folder else None)
        if not rollouts.record_trees or folder is None:
            return None
        tok = self.learner.tokenizer

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=False)

        return TreeWriter(
            folder, decode, source="train", max_groups=rollouts.record_max_groups, every=rollouts.record_every
        )

    def _run_folder(self) -> str | None:
        """Where this run's artifacts go: a Tune trial's folder in the sweep (its storage path, when local), else the
        Algorithm's log folder (with a remote storage, the trial's working folder, which Tune uploads when its
        ``SyncConfig(sync_artifacts=True)``; for a bare ``build_algo()``, the one run folder Ray's Trainable makes)."""
        storage = getattr(self, "_storage", None)
        if storage is not None and getattr(storage.storage_filesystem, "type_name", "") == "local":
            return storage.trial_fs_path
        return getattr(self, "logdir", None)

    def _record_trees(self, iteration: int, groups: list[Any]) -> None:
        """Record the groups this iteration trained on, with the advantages the learner's estimator gave them."""
        from arpo_algo.eval.trees import token_advantages

        writer = self.tree_writer
        if writer is None or iteration % writer.every:
            return
        chosen = groups if writer.max_groups is None else groups[: writer.max_groups]
        # the learner's pre-step log-probs of this update, per sequence in group order (absent on a remote learner)
        scored, learner = getattr(self.learner, "scored_logprobs", None), None
        if scored is not None and len(scored) == sum(len(g.trajectories) for g in groups):
            it = iter(scored)
            learner = [[next(it) for _ in g.trajectories] for g in groups][: len(chosen)]
        with self.metrics.log_time((MK.TIMERS.rstrip("/"), MK.RECORD_TIME)):
            credit = token_advantages(chosen, self.config.settings.training)
            writer.record(iteration, chosen, [c.advantages for c in credit], learner, [c.values for c in credit])

    # --------------------------------------------------------------------------------------------- one iteration

    def training_step(self) -> None:
        """One iteration: sync weights -> sample -> advantages -> update -> record. Returns None.

        The policy version is the number of updates applied, ``self.iteration`` at the start of the step; every
        trajectory records the version that sampled it. Asynchronous rollouts (:mod:`arpo_algo.algorithms.pipeline`)
        sample the next batch while this one trains; their steps 1-2 then ran in the background.
        """
        version = self.iteration
        # 1. sync the rollout engine to the learner's weights, and 2. sample one tree per prompt (rewards from the env)
        batch = self._sync_and_sample(version)
        # RLlib's on_sample_end: no EnvRunner here; the samples are the groups (one per prompt) this update trains on
        self._callback("on_sample_end", env_runner=None, samples=batch.groups)
        # 3. advantages and 4. the update, both inside the learner (the tree's advantages: training.advantage)
        learn, update_s = self._update(batch, version)
        # 5. record: metrics, the data position and the trees trained on
        self._record_step(batch, learn, update_s, version)
        return None

    def _sync_and_sample(self, version: int) -> Any:
        """Steps 1-2: the batch taken from the asynchronous pipe, or sampled now under freshly synced weights."""
        timers, pipe = MK.TIMERS.rstrip("/"), self.rollout_pipeline
        if self.records is not None:
            with self.metrics.log_time((timers, MK.ROLLOUT_TIME)):
                return self._take_records(version)
        if pipe is not None and pipe.in_flight:
            with self.metrics.log_time((timers, MK.ROLLOUT_TIME)):  # the wait for the batch in flight
                return pipe.take()
        with self.metrics.log_time((timers, MK.SYNC_TIME)):
            self._sync_weights()
        indices = self.prompts.next(self.config.settings.training.prompts_per_step)
        with self.metrics.log_time((timers, MK.ROLLOUT_TIME)):
            return self._sample_batch(indices, version)

    def _take_records(self, version: int) -> Any:
        """The next groups of recorded episodes (waiting up to ``training.records_wait_s`` for one to be ready)."""
        from arpo_algo.algorithms.pipeline import Batch

        training = self.config.settings.training
        groups, metrics, waited = self.records.wait(training.prompts_per_step, version, training.records_wait_s)
        return Batch(groups, metrics, version, waited)

    def _update(self, batch: Any, version: int) -> tuple[dict[str, float], float]:
        """Steps 3-4: the learner's advantages and update on ``batch``; starts the asynchronous pipe's next batch
        (before the update with staleness 1, after it with staleness 0). Returns the learner's metrics and the
        update's wall time."""
        timers, pipe = MK.TIMERS.rstrip("/"), self.rollout_pipeline
        behaviour = pipe.behaviour_weights(batch, version) if pipe is not None else None
        if pipe is not None and pipe.max_staleness == 1:  # the next batch overlaps this update
            self._start_next(version, timers)
        if hasattr(self.engine, "sleep") and pipe is None:  # free rollout memory for the update (HF: KV store
            self.engine.sleep()  # and weight copies; vLLM: GPU with sleep_between_rollouts only)
        t1 = time.perf_counter()
        with self.metrics.log_time((timers, MK.UPDATE_TIME)):
            learn = (
                self.learner.update(batch.groups)
                if behaviour is None
                else self.learner.update(batch.groups, behaviour_weights=behaviour)
            )
        update_s = time.perf_counter() - t1
        if pipe is not None and pipe.max_staleness == 0:  # sampled under the version this update produced
            self._start_next(version + 1, timers)
        return learn, update_s

    def _record_step(self, batch: Any, learn: dict[str, float], update_s: float, version: int) -> None:
        """Step 5: the iteration's metrics (rollout, learner, group diagnostics, data position) and its trees."""
        groups, rollout = batch.groups, batch.metrics
        if learn.get(LK.SKIPPED_NAN):
            self.metrics.log_value(MK.NAN_UPDATES_SKIPPED, float(learn[LK.SKIPPED_NAN]), reduce="sum")
        generated = rollout.get(MK.TOKENS_GENERATED, rollout[MK.TOKENS_SAMPLED])
        rollout[MK.TOKENS_PER_S] = generated / max(batch.sample_s, 1e-9)
        rollout[MK.UPDATE_TOKENS_PER_S] = rollout[MK.TOKENS_SAMPLED] / max(update_s, 1e-9)
        rollout.update(MK.staleness(groups, version))
        # Nested keys ("rollout/branches" -> result["rollout"]["branches"]) so Tune and TensorBoard show namespaces;
        # the trajectory-quality names (reward_mean, accuracy, ...) stay at the top level.
        for key, value in rollout.items():
            self.metrics.log_value(tuple(key.split("/")), float(value), reduce="mean", window=1)
        for key, value in learn.items():
            self.metrics.log_value((LK.PREFIX.rstrip("/"), *key.split("/")), float(value), reduce="mean", window=1)
        for key, value in group_diagnostics(groups).items():  # names defined in arpo_algo.rollout.diagnostics
            self.metrics.log_value(tuple(key.split("/")), float(value), reduce="mean", window=1)
        self.metrics.log_value(MK.TRAJECTORIES_LIFETIME, rollout[MK.TRAJECTORIES], reduce="lifetime_sum")
        self._log_rllib_names(groups)
        position = self.data_position()  # numbers only in the metrics: the carried tasks as a count
        position["carry"] = len(position.get("carry", ()))
        self.metrics.log_dict(position, key="data", reduce="mean", window=1)
        self._record_trees(version + 1, groups)  # iteration numbers as in metrics.jsonl (1 = the first update)

    def _log_rllib_names(self, groups: list[Any]) -> None:
        """RLlib's names for the iteration (:func:`arpo_algo.rollout.metrics.rllib_results`: an episode is a
        trajectory, an env step a model turn), under ``env_runners/`` with the lifetime counts also at the top level
        as RLlib reports them."""
        runners = MK.ENV_RUNNERS.rstrip("/")
        counts = MK.rllib_results(groups)
        for key, value in counts.items():
            self.metrics.log_value((runners, key), value, reduce="mean", window=1)
        for lifetime, key in (
            (MK.NUM_EPISODES_LIFETIME, MK.NUM_EPISODES),
            (MK.NUM_ENV_STEPS_SAMPLED_LIFETIME, MK.NUM_ENV_STEPS_SAMPLED),
        ):
            self.metrics.log_value((runners, lifetime), counts[key], reduce="lifetime_sum")
            self.metrics.log_value(lifetime, counts[key], reduce="lifetime_sum")

    def _sample(self, indices: list[int], step: int, version: int) -> tuple[list[Any], dict[str, float]]:
        training = self.config.settings.training
        return sample_groups(
            self.sampler,
            self.prompts,
            indices,
            step,
            dynamic=training.dynamic_sampling,
            max_rounds=training.dynamic_sampling_max_rounds,
            policy_version=version,
        )

    def _sample_batch(self, indices: list[int], version: int) -> Any:
        from arpo_algo.algorithms.pipeline import Batch

        t0 = time.perf_counter()
        groups, metrics = self._sample(indices, self.iteration, version)
        return Batch(groups, metrics, version, time.perf_counter() - t0)

    def _start_next(self, version: int, timers: str) -> None:
        """Push ``version``'s weights (the learner holds them now) and start sampling the next iteration's prompts
        under them in the background; with staleness 1 keep a copy, which scores that batch after this update."""
        with self.metrics.log_time((timers, MK.SYNC_TIME)):
            weights = {k: v.detach().clone() for k, v in self.learner.rollout_weights().items()}
            self._push_weights(weights)
        before = self.prompts.get_state()
        indices = self.prompts.next(self.config.settings.training.prompts_per_step)
        snapshot = weights if self.rollout_pipeline.max_staleness > 0 else None
        self.rollout_pipeline.start(indices, self.iteration + 1, version, before, snapshot)

    def data_position(self) -> dict[str, int]:
        """The data position of the batches trained on (a batch in flight is sampled again after a resume)."""
        current = self.prompts.get_state()
        return self.rollout_pipeline.prompts_state(current) if self.rollout_pipeline is not None else current

    def _push_weights(self, weights: dict[str, Any]) -> None:
        """Send ``weights`` to the engine. For an engine that counts its pushes (vLLM) two metrics are logged:
        ``rollout/engine/weight_push_seconds``, the wall time this process waited for the push (measured here: with
        rollout actors the engines load in parallel, so their own timings must not be added up), and
        ``rollout/engine/weight_push_bytes``, the bytes written for all engines together (N rollout actors: N
        copies). Reading the counters resets the engine's others, which the sampler resets anyway before the next
        rollout."""
        t0 = time.perf_counter()
        self.engine.load_state_dict(weights)
        seconds = time.perf_counter() - t0
        stats = self.engine.stats() if hasattr(self.engine, "stats") else {}
        if "weight_push_bytes" in stats:
            for key, value in (("weight_push_bytes", stats["weight_push_bytes"]), ("weight_push_seconds", seconds)):
                self.metrics.log_value(
                    tuple(f"{MK.ROLLOUT}engine/{key}".split("/")), float(value), reduce="mean", window=1
                )

    def _sync_weights(self) -> None:
        """The in-process HF engine shares a local learner's module (nothing to copy, but it is told the weights
        changed); other engines get the weights (rank 0's with ddp/deepspeed)."""
        if self._engine_owns_weights():
            self._push_weights(self.learner.rollout_weights())
        else:  # shared module: nothing to copy, but the engine's KV and weight copies predate the last update
            self.engine.weights_updated()

    # ---------------------------------------------------------------------------------------------- evaluation

    def evaluate(self, parallel_train_future: Any = None) -> dict[str, float]:
        """Score the held-out split (flat dict; RLlib nests it under ``result["evaluation"]``)."""
        from arpo_algo.eval.evaluation import evaluate_policy

        if self.rollout_pipeline is not None:  # a tree in flight is finished under the weights it started with
            self.rollout_pipeline.wait()
        self._sync_weights()
        self._callback("on_evaluate_start", algorithm=self)
        self._last_eval = evaluate_policy(self, self._eval_env)
        self._callback("on_evaluate_end", algorithm=self, evaluation_metrics=dict(self._last_eval))
        return dict(self._last_eval)

    # ------------------------------------------------------------------------------ RLlib's inference methods

    def compute_single_action(
        self, observation: str | None = None, *args: Any, explore: bool | None = None, **kwargs: Any
    ) -> str:
        """The agent's response to the prompt ``observation``, as ``arpo serve`` would give it: current weights,
        greedy (``explore=True`` samples), the training environment's system prompt, tools and limits
        (:mod:`arpo_algo.algorithms.answer`). Returns the whole response: its text, tool calls and their results."""
        from arpo_algo.algorithms.answer import answer_prompts, check_prompts

        check_prompts([observation], dict(kwargs, state=args[0] if args else None))
        return answer_prompts(self, [observation], explore=bool(explore))[0]

    def compute_actions(self, observations: Any, *args: Any, explore: bool | None = None, **kwargs: Any) -> Any:
        """:meth:`compute_single_action` for many prompts at once (one batched agent loop): a dict of prompts gives a
        dict of responses under the same keys, a list gives a list."""
        from arpo_algo.algorithms.answer import answer_prompts, check_prompts

        keys = list(observations) if isinstance(observations, dict) else None
        prompts = [observations[k] for k in keys] if keys is not None else list(observations)
        check_prompts(prompts, dict(kwargs, state=args[0] if args else None))
        answers = answer_prompts(self, prompts, explore=bool(explore))
        return dict(zip(keys, answers)) if keys is not None else answers

    def _no_rllib_module(self, name: str) -> ArpoError:
        return ArpoError(
            f"{type(self).__name__}.{name}() returns an RLlib RLModule or Policy, which arpo does not build: its "
            "policy is a Hugging Face causal LM",
            hint="use algo.learner.model and algo.learner.tokenizer, algo.compute_single_action(prompt) for an "
            "answer, `arpo serve` to serve it or `arpo eval` / algo.evaluate() to score it",
        )

    def get_module(self, *args: Any, **kwargs: Any) -> Any:
        raise self._no_rllib_module("get_module")

    def get_policy(self, *args: Any, **kwargs: Any) -> Any:
        raise self._no_rllib_module("get_policy")

    # --------------------------------------------------------------------------------------------- checkpoints

    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self._check_component(POLICY_DIR, components, not_components):
            state[POLICY_DIR] = self.policy.get_state()
        state["metrics_logger"] = self.metrics.get_state()
        state["training_iteration"] = self.training_iteration
        state["prompts"] = self.data_position()
        if self.records is not None:
            state["records"] = self.records.get_state()
        state["arpo_checkpoint_format"] = CHECKPOINT_FORMAT
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("arpo_checkpoint_format") != CHECKPOINT_FORMAT:
            raise ArpoError(
                f"incompatible algorithm state: format {state.get('arpo_checkpoint_format')!r}, this "
                f"arpo reads format {CHECKPOINT_FORMAT}"
            )
        self._discard_in_flight()
        if POLICY_DIR in state:
            self.policy.set_state(state[POLICY_DIR])
        if "metrics_logger" in state:
            self.metrics.set_state(state["metrics_logger"])
        if "training_iteration" in state:
            self._iteration = state["training_iteration"]
        if "prompts" in state:
            self.prompts.set_state(state["prompts"])
        if "records" in state and self.records is not None:
            self.records.set_state(state["records"])

    def get_checkpointable_components(self) -> list[tuple[str, Checkpointable]]:
        return [(POLICY_DIR, self.policy)]

    def get_metadata(self) -> dict[str, Any]:
        meta = super().get_metadata()
        meta.update(
            arpo_version=__version__, arpo_checkpoint_format=CHECKPOINT_FORMAT, arpo_algorithm=type(self).__name__
        )
        return meta

    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack=False) -> str:  # type: ignore
        """Write a data-only checkpoint (:mod:`arpo_algo.algorithms.checkpoint`); Tune's checkpoints come here too."""
        import tempfile

        return str(write_checkpoint(self, pathlib.Path(path or tempfile.mkdtemp(prefix="arpo_ckpt_"))))

    def restore_from_path(self, path, *args, **kwargs) -> None:
        """Restore a data-only checkpoint in place (Tune's restores come here too); nothing in it is executed."""
        self._discard_in_flight()
        restore_checkpoint(self, path)

    def _discard_in_flight(self) -> None:
        """A batch in flight was drawn from the weights and data position a restore replaces: drop it."""
        if getattr(self, "rollout_pipeline", None) is not None:
            self.rollout_pipeline.discard()

    @classmethod
    def from_checkpoint(cls, path, filesystem=None, **kwargs) -> AgenticRLAlgorithm:  # type: ignore[override]
        """A new Algorithm built from a checkpoint's own settings (JSON) and restored from it."""
        state = read_checkpoint_state(path)
        algo_cls = _algorithm_class(cls, state["algorithm"])
        config = config_from_state(state, type(algo_cls.get_default_config()), str(path))
        # where a Tune trial's process ran is not a setting of the run: the restored Algorithm runs in this process
        algo = config.backend(main_resources={}).build_algo()
        try:
            algo.restore_from_path(path)
        except BaseException:
            algo.stop()
            raise
        return algo

    def restore_env_runners(self, env_runner_group: Any) -> list[int]:
        return []

    def cleanup(self) -> None:
        """Close the sampler (its tool threads) and the engine (actors, engine processes); stop Ray if setup started
        it. Best effort: a part that fails to close (e.g. actors already killed for memory) is logged, and the rest,
        Ray's shutdown included, still happens, so a failed run never leaves a Ray session behind."""
        import logging

        try:
            for part in ("rollout_pipeline", "sampler", "engine", "learner"):
                if getattr(self, part, None) is not None:
                    try:
                        getattr(self, part).close()
                    except Exception as e:  # noqa: BLE001 - cleanup goes on; the run's own error was reported already
                        logging.getLogger(__name__).warning("closing the %s failed: %r", part, e)
            super().cleanup()
        finally:
            if getattr(self, "_owns_ray", False):
                import ray

                ray.shutdown()
