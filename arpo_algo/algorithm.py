"""ARPO, AEPO and GRPO as thin RLlib Algorithms (RAY_NOTES §1.2, "Pattern A").

The algorithm owns its policy (:class:`arpo_algo.learner.Learner`: HF model, optimizer, schedule, RNG) and its
rollout component (:class:`arpo_algo.sampler.TreeSampler` over an in-process :class:`arpo_algo.engines.hf.HFEngine`
that shares the learner's module, or over a :class:`arpo_algo.engines.actors.RolloutActorPool`). RLlib provides the
config, the metrics logger, Tune integration and checkpoints; no EnvRunners, RLModules or LearnerGroups are built.

One iteration (:meth:`ARPO.training_step`): sync weights -> sample one group per prompt (rewards come from the
environment's final step) -> advantages and update (inside the learner) -> log.

Checkpoints (``save_to_path`` / ``restore_from_path`` / ``from_checkpoint`` / Tune's save and restore)::

    ckpt/ rllib_checkpoint.json  class_and_ctor_args.pkl  algorithm_state.pkl   (iteration, data position, metrics)
          policy/  model.safetensors config.json tokenizer* chat_template.jinja generation_config.json   (plain HF)
                   trainer_state.pt   (optimizer, scheduler, RNG, learner step)

``policy/`` loads with ``AutoModelForCausalLM.from_pretrained`` and in vLLM directly. ``rllib_checkpoint.json``
records the arpo version and :data:`CHECKPOINT_FORMAT`; a different format is refused with a clear error.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import random
import time
from typing import Any

from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.utils.checkpoints import Checkpointable
from ray.tune.execution.placement_groups import PlacementGroupFactory

import arpo_algo
from arpo_algo.config import AEPOConfig, ARPOConfig, GRPOConfig
from arpo_env.errors import ArpoError, ConfigError

#: Bumped whenever the checkpoint layout or state keys change incompatibly.
CHECKPOINT_FORMAT = 1
POLICY_DIR = "policy"
TRAINER_STATE_FILE = "trainer_state.pt"


# ------------------------------------------------------------------------------------------------------ data order


class PromptIterator:
    """Which prompts come next: a seeded permutation per epoch, position kept in checkpoints.

    Resuming a run restores (epoch, position), so a killed run continues with exactly the prompts it would have seen.
    """

    def __init__(self, num_tasks: int, seed: int) -> None:
        if num_tasks < 1:
            raise ConfigError("the training split has no tasks")
        self.num_tasks, self.seed, self.epoch, self.position = num_tasks, seed, 0, 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_tasks))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        """The next ``k`` task indices (crossing epoch borders; each epoch is a fresh permutation)."""
        out: list[int] = []
        while len(out) < k:
            order = self._order(self.epoch)
            take = order[self.position:self.position + k - len(out)]
            out += take
            self.position += len(take)
            if self.position >= self.num_tasks:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def get_state(self) -> dict[str, int]:
        return {"num_tasks": self.num_tasks, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        if state["num_tasks"] != self.num_tasks:
            raise ArpoError(f"the checkpoint was trained on {state['num_tasks']} tasks, this run has "
                            f"{self.num_tasks}", hint="resume with the same env config (split, data)")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]


# ---------------------------------------------------------------------------------------------------- environments


def make_env(env_id: str, env_config: dict[str, Any], overrides: dict[str, Any] | None = None) -> Any:
    """One unwrapped ToolTextEnv (gymnasium wrappers would hide ``clone()``); module level so actors can pickle it."""
    import gymnasium as gym

    import arpo_env  # registers the arpo/* ids

    try:
        env = gym.make(env_id, config={**env_config, **(overrides or {})}, disable_env_checker=True)
    except gym.error.Error as e:
        raise ConfigError(f"environment {env_id!r} cannot be made: {e}",
                          hint=f"registered arpo environments: {', '.join(arpo_env.ENV_IDS)}") from e
    return env.unwrapped


def env_creator(config: ARPOConfig, **overrides: Any) -> functools.partial:
    """A picklable zero-argument env factory for the sampler (and rollout actors)."""
    if not isinstance(config.env, str):
        raise ConfigError(f"env must be a registered id such as 'arpo/ToolMath-v0', got {config.env!r}")
    return functools.partial(make_env, config.env, dict(config.env_config), overrides)


# ------------------------------------------------------------------------------------------------------- resources


def resource_bundles(config: ARPOConfig) -> list[dict[str, float]]:
    """One bundle for the learner process plus one per rollout actor."""
    main = {"CPU": float(config.num_cpus_for_main_process), "GPU": 1.0 if config.device == "cuda" else 0.0}
    return [main] + [{"CPU": float(config.num_cpus_per_rollout_actor)}] * config.num_rollout_actors


def check_resources_feasible(bundles: list[dict[str, float]]) -> None:
    """Fail fast instead of leaving a Tune trial PENDING forever (RAY_NOTES §2: infeasible requests hang silently).

    Compares against ``ray.cluster_resources()`` when Ray is initialised, else against this machine.
    """
    import ray

    need_cpu = sum(b.get("CPU", 0.0) for b in bundles)
    need_gpu = sum(b.get("GPU", 0.0) for b in bundles)
    if ray.is_initialized():
        have = ray.cluster_resources()
        have_cpu, have_gpu, where = have.get("CPU", 0.0), have.get("GPU", 0.0), "the Ray cluster"
    else:
        import torch

        have_cpu, where = float(os.cpu_count() or 1), "this machine"
        have_gpu = float(torch.cuda.device_count())
    if need_cpu > have_cpu:
        actors = len(bundles) - 1
        raise ConfigError(
            f"this ARPO config needs {need_cpu:g} CPUs ({bundles[0]['CPU']:g} for the learner + {actors} rollout "
            f"actor(s) x {bundles[-1]['CPU'] if actors else 0:g}) but {where} has {have_cpu:g}",
            hint="lower llm_rollouts(num_rollout_actors=..., num_cpus_per_rollout_actor=...) or give Ray more CPUs")
    if need_gpu > have_gpu:
        raise ConfigError(f"this ARPO config needs {need_gpu:g} GPU(s) (device='cuda') but {where} has {have_gpu:g}",
                          hint="use llm_rollouts(device='cpu') on this machine")


# ---------------------------------------------------------------------------------------------- policy component


class PolicyComponent(Checkpointable):
    """The learner as a checkpoint component: a plain HF folder plus ``trainer_state.pt`` (optimizer, RNG, step)."""

    def __init__(self, learner: Any) -> None:
        self.learner = learner

    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict[str, Any]:
        return {"trainer": self.learner.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.learner.set_state(state["trainer"])

    def get_ctor_args_and_kwargs(self) -> tuple[tuple, dict[str, Any]]:
        return (), {}

    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack=False) -> str:  # noqa: D401
        """Write the HF folder (weights as they are now) and the trainer state."""
        import torch

        path = pathlib.Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.learner.save_pretrained(path)
        torch.save((state or self.get_state())["trainer"], path / TRAINER_STATE_FILE)
        return str(path)

    def restore_from_path(self, path, *, component=None, filesystem=None, **kwargs) -> None:
        """Load weights in place (the in-process engine shares the module) and the trainer state."""
        import torch
        from transformers import AutoModelForCausalLM

        path = pathlib.Path(path)
        model = self.learner.model
        saved = AutoModelForCausalLM.from_pretrained(path, dtype=next(model.parameters()).dtype)
        with torch.no_grad():
            model.load_state_dict(saved.state_dict())
        del saved
        trainer = torch.load(path / TRAINER_STATE_FILE, weights_only=False)
        self.learner.set_state(trainer)


# ------------------------------------------------------------------------------------------------------ algorithm


class ARPO(Algorithm):
    """Agentic Reinforced Policy Optimization (arXiv 2507.19849) as a thin RLlib Algorithm."""

    @classmethod
    def get_default_config(cls) -> ARPOConfig:
        return ARPOConfig(algo_class=cls)

    @classmethod
    def default_resource_request(cls, config: AlgorithmConfig | dict) -> PlacementGroupFactory:
        """What Tune reserves per trial: the learner process plus every rollout actor; infeasible -> ConfigError."""
        cfg = config if isinstance(config, ARPOConfig) else cls.get_default_config().update_from_dict(dict(config))
        bundles = resource_bundles(cfg)
        check_resources_feasible(bundles)
        return PlacementGroupFactory(bundles, strategy=cfg.placement_strategy)

    # ---------------------------------------------------------------------------------------------------- setup

    def setup(self, config: ARPOConfig) -> None:
        """Build learner, engine and sampler; no ``super().setup()`` (no EnvRunners or LearnerGroup)."""
        from arpo_algo.learner import Learner
        from arpo_algo.models import resolve_model_path

        self.callbacks = [c() for c in _as_list(self.config.callbacks_class)]
        self.env_runner_group = self.eval_env_runner_group = None
        self.offline_data = self.learner_group = self._aggregator_actor_manager = None
        self.offline_eval_runner_group = None
        self.evaluation_config = self.config.get_evaluation_config_object()
        self._set_up_metrics()  # step() and save() time themselves with these (RAY_NOTES §1.4.2)
        cfg = self.config
        check_resources_feasible(resource_bundles(cfg))
        model_path = resolve_model_path(cfg.model_path)
        self.learner = Learner(model_path, cfg.learner_config(), device=cfg.device, seed=cfg.seed)
        self.policy = PolicyComponent(self.learner)
        self.tree_config = cfg.tree_config()
        self._train_env = env_creator(cfg)
        self._eval_env = env_creator(cfg, split=cfg.eval_split)
        self.prompts = PromptIterator(self._train_env().num_tasks, cfg.seed)
        self.engine = self._build_engine(model_path)
        self.sampler = self._build_sampler(self._train_env, self.tree_config, cfg.temperature, cfg.top_p, cfg.top_k,
                                           cfg.max_response_tokens, dump=cfg.dump_trees)
        self._last_eval: dict[str, float] = {}

    def _build_engine(self, model_path: pathlib.Path) -> Any:
        from arpo_algo.engines.hf import HFEngine

        cfg = self.config
        entropy = "topk_sum_lnV" if self.tree_config.entropy_method == "topk_sum_lnV" else "full"
        if cfg.num_rollout_actors == 0:
            return HFEngine(model=self.learner.model, tokenizer=self.learner.tokenizer, dtype=cfg.dtype,
                            max_batch_size=cfg.max_batch_size, entropy_method=entropy, seed=cfg.seed,
                            linear_layout=cfg.linear_layout)
        import ray

        from arpo_algo.engines.actors import RolloutActorPool

        if not ray.is_initialized():
            ray.init(num_cpus=int(sum(b["CPU"] for b in resource_bundles(cfg))), include_dashboard=False)
        factory = functools.partial(HFEngine, str(model_path), device=cfg.device, dtype=cfg.dtype,
                                    max_batch_size=cfg.max_batch_size, entropy_method=entropy, seed=cfg.seed,
                            linear_layout=cfg.linear_layout)
        return RolloutActorPool(factory, num_actors=cfg.num_rollout_actors,
                                num_cpus_per_actor=cfg.num_cpus_per_rollout_actor)

    def _build_sampler(self, creator: Any, tree: Any, temperature: float, top_p: float, top_k: int,
                       max_response_tokens: int, dump: bool = False) -> Any:
        from arpo_algo.engines.base import SamplingParams
        from arpo_algo.sampler import TreeSampler

        cfg = self.config
        env = creator()
        sampling = SamplingParams(max_new_tokens=max_response_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, stop=tuple(env.stop_sequences))
        dump_path = os.path.join(self.logdir, "trees.jsonl") if dump and getattr(self, "logdir", None) else None
        return TreeSampler(self.engine, creator, tree, sampling, max_response_tokens=max_response_tokens,
                           tool_workers=cfg.tool_workers, prompt_overflow=cfg.prompt_overflow,
                           train_tool_limit_eos=cfg.train_tool_limit_eos, seed=cfg.seed, dump_path=dump_path)

    # --------------------------------------------------------------------------------------------- one iteration

    def training_step(self) -> None:
        """sync weights -> sample groups (rewards from the env) -> advantages + update -> metrics. Returns None."""
        step = self.iteration
        with self.metrics.log_time(("timers", "sync_time")):
            self._sync_weights()
        indices = self.prompts.next(self.config.prompts_per_step)
        t0 = time.perf_counter()
        with self.metrics.log_time(("timers", "rollout_time")):
            groups, rollout = self.sampler.sample(indices, step=step)
        t1 = time.perf_counter()
        with self.metrics.log_time(("timers", "update_time")):
            learn = self.learner.update(groups)
        t2 = time.perf_counter()
        if learn.get("skipped_nan"):
            self.metrics.log_value("nan_updates_skipped", float(learn["skipped_nan"]), reduce="sum")
        summary = summarize_groups(groups)
        generated = float(rollout.get("tokens_generated", summary["tokens_sampled"]))
        summary["tokens_per_s"] = generated / max(t1 - t0, 1e-9)
        summary["update_tokens_per_s"] = summary["tokens_sampled"] / max(t2 - t1, 1e-9)
        for key, value in summary.items():
            self.metrics.log_value(key, value, reduce="mean", window=1)
        # Nested keys ("rollout/branches" -> result["rollout"]["branches"]) so Tune and TensorBoard show namespaces.
        for key, value in rollout.items():
            self.metrics.log_value(tuple(key.split("/")), float(value), reduce="mean", window=1)
        for key, value in learn.items():
            self.metrics.log_value(("learner", *key.split("/")), float(value), reduce="mean", window=1)
        self.metrics.log_value("num_trajectories_lifetime", float(summary["num_trajectories"]),
                               reduce="lifetime_sum")
        self.metrics.log_dict(self.prompts.get_state(), key="data", reduce="mean", window=1)
        return None

    def _sync_weights(self) -> None:
        """In-process the engine shares the learner's module (nothing to copy); actors get a broadcast."""
        if self.config.num_rollout_actors > 0:
            self.engine.broadcast({k: v.detach().cpu() for k, v in self.learner.model.state_dict().items()})

    # ---------------------------------------------------------------------------------------------- evaluation

    def evaluate(self, parallel_train_future: Any = None) -> dict[str, float]:
        """Score the held-out split (flat dict; RLlib nests it under ``result["evaluation"]``)."""
        from arpo_algo.evaluation import evaluate_policy

        self._sync_weights()
        self._last_eval = evaluate_policy(self, self._eval_env)
        return dict(self._last_eval)

    # --------------------------------------------------------------------------------------------- checkpoints

    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self._check_component(POLICY_DIR, components, not_components):
            state[POLICY_DIR] = self.policy.get_state()
        state["metrics_logger"] = self.metrics.get_state()
        state["training_iteration"] = self.training_iteration
        state["prompts"] = self.prompts.get_state()
        state["arpo_checkpoint_format"] = CHECKPOINT_FORMAT
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        _check_format(state.get("arpo_checkpoint_format"), "algorithm state")
        if POLICY_DIR in state:
            self.policy.set_state(state[POLICY_DIR])
        if "metrics_logger" in state:
            self.metrics.set_state(state["metrics_logger"])
        if "training_iteration" in state:
            self._iteration = state["training_iteration"]
        if "prompts" in state:
            self.prompts.set_state(state["prompts"])

    def get_checkpointable_components(self) -> list[tuple[str, Checkpointable]]:
        return [(POLICY_DIR, self.policy)]

    def get_metadata(self) -> dict[str, Any]:
        meta = super().get_metadata()
        meta.update(arpo_version=arpo_algo.__version__, arpo_checkpoint_format=CHECKPOINT_FORMAT,
                    arpo_algorithm=type(self).__name__)
        return meta

    def restore_from_path(self, path, *args, **kwargs) -> None:
        """Checkpointable's restore (the base one syncs EnvRunners we do not have), after a version check."""
        check_checkpoint(path)
        Checkpointable.restore_from_path(self, path, *args, **kwargs)

    @classmethod
    def from_checkpoint(cls, path, filesystem=None, **kwargs) -> ARPO:  # type: ignore[override]
        check_checkpoint(path)
        return super().from_checkpoint(path, filesystem=filesystem, **kwargs)

    def restore_env_runners(self, env_runner_group: Any) -> list[int]:
        return []

    def cleanup(self) -> None:
        """Stop rollout actors (the in-process engine needs nothing)."""
        shutdown = getattr(getattr(self, "engine", None), "shutdown", None)
        if self.config.num_rollout_actors > 0 and shutdown is not None:
            shutdown()
        super().cleanup()


class AEPO(ARPO):
    """Agentic Entropy-Balanced Policy Optimization (arXiv 2510.14545): ARPO with AEPO defaults (AEPOConfig)."""

    @classmethod
    def get_default_config(cls) -> AEPOConfig:
        return AEPOConfig(algo_class=cls)


class GRPO(ARPO):
    """The GRPO baseline: same code path, tree sampler off (GRPOConfig)."""

    @classmethod
    def get_default_config(cls) -> GRPOConfig:
        return GRPOConfig(algo_class=cls)


# --------------------------------------------------------------------------------------------------------- helpers


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _check_format(fmt: Any, what: str) -> None:
    if fmt != CHECKPOINT_FORMAT:
        raise ArpoError(f"incompatible checkpoint: {what} has format {fmt!r}, this arpo "
                        f"({arpo_algo.__version__}) reads format {CHECKPOINT_FORMAT}",
                        hint="resume with the arpo version that wrote it, or start a new run from its policy/ folder")


def check_checkpoint(path: str | os.PathLike | Any) -> None:
    """Refuse a folder that is not an arpo checkpoint of this format, with a clear message."""
    path = pathlib.Path(getattr(path, "path", path))
    meta_file = path / "rllib_checkpoint.json"
    if not meta_file.is_file():
        raise ArpoError(f"{path} is not an arpo checkpoint (no rllib_checkpoint.json)",
                        hint="pass a folder like <run>/checkpoints/iter_000010")
    meta = json.loads(meta_file.read_text())
    if "arpo_checkpoint_format" not in meta:
        raise ArpoError(f"{path} is an RLlib checkpoint but not an arpo one (no arpo_checkpoint_format)")
    _check_format(meta["arpo_checkpoint_format"], f"checkpoint {path} (arpo {meta.get('arpo_version')})")


def summarize_groups(groups: list[Any]) -> dict[str, float]:
    """Per-iteration training metrics computed from the sampled groups themselves."""
    trajs = [t for g in groups for t in g.trajectories]
    n = max(len(trajs), 1)
    rewards = [t.reward for t in trajs]
    sampled = sum(sum(t.trained_mask) for t in trajs)
    return {
        "reward_mean": sum(rewards) / n,
        "reward_max": max(rewards) if rewards else 0.0,
        "accuracy": sum(1.0 for t in trajs if _is_correct(t)) / n,
        "tool_calls_per_traj": sum(len(t.tool_calls) for t in trajs) / n,
        "branches": float(sum(1 for t in trajs if t.kind == "branch")),
        "response_len": sum(len(t.response_ids) for t in trajs) / n,
        "tokens_sampled": float(sampled),
        "num_trajectories": float(len(trajs)),
    }


def _is_correct(traj: Any) -> bool:
    from arpo_algo.evaluation import is_correct

    return is_correct(traj)
