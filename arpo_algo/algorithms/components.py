"""The parts of every variant's Algorithm: data order, environment factory, resources and the policy checkpoint
component (the checkpoint files themselves: :mod:`arpo_algo.algorithms.checkpoint`)."""

from __future__ import annotations

import functools
import pathlib
import random
from typing import Any

from ray.rllib.utils.checkpoints import Checkpointable

from arpo_algo.algorithms.checkpoint import TRAINER_STATE_FILE, load_trainer_state, save_trainer_state
from arpo_base.errors import ArpoError, ConfigError

# ------------------------------------------------------------------------------------------------------ data order


class PromptIterator:
    """Which prompts come next: a seeded permutation per epoch, position kept in checkpoints.

    Resuming a run restores (epoch, position, carry), so a killed run continues with exactly the prompts it would
    have seen. One call never returns a task twice (nor one in ``exclude``): the sampler's seeds depend only on the
    step and the task, so a repeated task would be a bit-identical group counted twice. A task that would repeat (at
    an epoch border, or a dynamic-sampling round) is carried to the next call instead, so every epoch still yields
    each task exactly once.
    """

    def __init__(self, num_tasks: int, seed: int) -> None:
        if num_tasks < 1:
            raise ConfigError("the training split has no tasks")
        self.num_tasks, self.seed, self.epoch, self.position = num_tasks, seed, 0, 0
        self.carry: list[int] = []

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_tasks))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next(self, k: int, exclude: Any = ()) -> list[int]:
        """The next ``k`` distinct task indices, none in ``exclude`` (crossing epoch borders; each epoch is a fresh
        permutation; a task skipped as a repeat comes first in a later call)."""
        taken = set(exclude)
        if k + len(taken) > self.num_tasks:
            raise ConfigError(
                f"{k} distinct tasks are asked for in one step (besides {len(taken)} already drawn), "
                f"the training split has {self.num_tasks}",
                hint="lower training.prompts_per_step to at most the number of training tasks",
            )
        out: list[int] = []
        carry, self.carry = self.carry, []
        for i in carry:
            if len(out) < k and i not in taken:
                out.append(i)
                taken.add(i)
            else:
                self.carry.append(i)
        order = self._order(self.epoch)
        while len(out) < k:
            i = order[self.position]
            self.position += 1
            if self.position >= self.num_tasks:
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order(self.epoch)
            if i in taken:
                self.carry.append(i)
            else:
                out.append(i)
                taken.add(i)
        return out

    def get_state(self) -> dict[str, Any]:
        return {
            "num_tasks": self.num_tasks,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "carry": list(self.carry),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state["num_tasks"] != self.num_tasks:
            raise ArpoError(
                f"the checkpoint was trained on {state['num_tasks']} tasks, this run has {self.num_tasks}",
                hint="resume with the same env config (split, data)",
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.carry = list(state["carry"])


# ---------------------------------------------------------------------------------------------------- environments


def make_env(env_id: str, env_config: dict[str, Any], overrides: dict[str, Any] | None = None) -> Any:
    """One unwrapped ToolTextEnv (gymnasium wrappers would hide ``clone()``); module level so actors can pickle it."""
    import gymnasium as gym

    import arpo_env  # registers the arpo/* ids

    try:
        env = gym.make(env_id, config={**env_config, **(overrides or {})}, disable_env_checker=True)
    except gym.error.Error as e:
        raise ConfigError(
            f"environment {env_id!r} cannot be made: {e}",
            hint=f"registered arpo environments: {', '.join(arpo_env.ENV_IDS)}",
        ) from e
    return env.unwrapped


def tune_env_creator(name: str) -> Any:
    """The creator registered under ``name`` with ``ray.tune.register_env``, or None."""
    from ray.tune.registry import ENV_CREATOR, _global_registry

    return _global_registry.get(ENV_CREATOR, name) if _global_registry.contains(ENV_CREATOR, name) else None


def make_env_from(env: Any, env_config: dict[str, Any], overrides: dict[str, Any] | None = None) -> Any:
    """One unwrapped ToolTextEnv from any form RLlib's ``.environment(env=...)`` takes: a name registered with
    ``tune.register_env`` (its creator gets an ``EnvContext``, as RLlib calls it), a Gymnasium id, an env class
    (called with ``config=``) or a creator. arpo's sampler drives a ToolTextEnv (text in and out, ``clone()``):
    anything else is refused, naming what was made."""
    from ray.rllib.env.env_context import EnvContext

    from arpo_env.core import ToolTextEnv

    merged = {**env_config, **(overrides or {})}
    creator = tune_env_creator(env) if isinstance(env, str) else None
    if isinstance(env, str) and creator is None:
        return make_env(env, env_config, overrides)
    if creator is None and isinstance(env, type):
        made = env(config=merged)
    else:
        made = (creator or env)(EnvContext(merged, worker_index=0))
    made = getattr(made, "unwrapped", made)
    if not isinstance(made, ToolTextEnv):
        raise ConfigError(
            f"environment {env!r} made a {type(made).__name__}; arpo's sampler drives arpo_env.ToolTextEnv "
            "(text observations and actions, clone())",
            hint="return a ToolTextEnv (or a subclass) from the env class or creator",
        )
    return made


def env_creator(config: Any, **overrides: Any) -> functools.partial:
    """A picklable zero-argument env factory for the sampler (and rollout actors), for every form
    :func:`make_env_from` takes."""
    env = config.env
    if not (isinstance(env, str) or callable(env)):
        raise ConfigError(
            f"env must be a Gymnasium id, a name registered with tune.register_env, an env class or a creator, "
            f"got {env!r}",
            hint="config.environment('arpo/ToolMath-v0', env_config={...})",
        )
    if isinstance(env, str) and tune_env_creator(env) is None:
        return functools.partial(make_env, env, dict(config.env_config), overrides)
    return functools.partial(make_env_from, env, dict(config.env_config), overrides)


# ------------------------------------------------------------------------------------------------------- resources


def resource_bundles(config: Any) -> list[dict[str, float]]:
    """One bundle for the main process, then one per learner rank (learner_backend 'ddp'/'deepspeed'), then one per
    rollout actor.

    The main process holds the GPU when ``device='cuda'`` and it runs the learner ("local") or the in-process engine;
    with a colocated learner it leaves the ranks' share of that GPU to them.
    """
    backend, rollouts = config.settings.backend, config.settings.rollouts
    workers = backend.worker_bundles(rollouts.device)
    in_process_gpu = rollouts.device == "cuda" and (not backend.distributed or rollouts.num_rollout_actors == 0)
    gpu = 0.0
    if in_process_gpu:
        gpu = 1.0 - workers[0].get("GPU", 0.0) if workers and backend.learner_placement == "colocated" else 1.0
    from arpo_algo.rollout.config import per_actor

    main = {
        "CPU": float(config.num_cpus_for_main_process),
        "GPU": gpu,
        **{k: float(v) for k, v in backend.main_resources.items()},
    }
    actors = [
        {"CPU": float(rollouts.num_cpus_per_rollout_actor), **custom}
        for custom in per_actor(rollouts.actor_resources, rollouts.num_rollout_actors)
    ]
    return [main] + workers + actors


def check_resources_feasible(bundles: list[dict[str, float]], learner_workers: int = 0) -> None:
    """Fail fast instead of leaving a Tune trial PENDING forever (infeasible requests hang silently:
    docs/howto/rllib.md#infeasible-resources).

    ``bundles`` as :func:`resource_bundles` lays them out, with ``learner_workers`` learner-rank bundles after the
    main one. Compares against ``ray.cluster_resources()`` when Ray is initialised, else against this machine.
    """
    from arpo_algo.train.backend_config import cluster_resources

    need_cpu = sum(b.get("CPU", 0.0) for b in bundles)
    need_gpu = sum(b.get("GPU", 0.0) for b in bundles)
    have, where = cluster_resources()
    ranks, actors = bundles[1 : 1 + learner_workers], bundles[1 + learner_workers :]
    parts = [f"{bundles[0]['CPU']:g} for the main process"]
    if ranks:
        parts.append(f"{len(ranks)} learner worker(s) x {ranks[0]['CPU']:g}")
    parts.append(f"{len(actors)} rollout actor(s) x {actors[0]['CPU'] if actors else 0:g}")
    gpu_parts = f"{bundles[0].get('GPU', 0.0):g} for the main process" + (
        f" + {len(ranks)} learner worker(s) x {ranks[0].get('GPU', 0.0):g}" if ranks else ""
    )
    check_custom_feasible(bundles, have, where)
    if need_cpu <= have["CPU"] and need_gpu <= have["GPU"] + 1e-9:
        return
    hint = (
        (
            "lower rollouts.num_rollout_actors / rollouts.num_cpus_per_rollout_actor or backend.learner_workers / "
            "backend.learner_cpus_per_worker, or give Ray more CPUs"
        )
        if need_cpu > have["CPU"]
        else ("use rollouts.device = 'cpu' on this machine, or fewer backend.learner_workers")
    )
    raise ConfigError(
        f"this ARPO config needs {need_cpu:g} CPUs ({' + '.join(parts)}) and {need_gpu:g} GPU(s) "
        f"({gpu_parts}; device={'cuda' if need_gpu else 'cpu'!r}) but {where} has {have['CPU']:g} "
        f"CPUs and {have['GPU']:g} GPU(s)",
        hint=hint,
    )


SETTINGS_NAMES = "rollouts.actor_resources / backend.worker_resources / backend.main_resources"


def check_custom_feasible(bundles: list[dict[str, float]], have: dict[str, float], where: str) -> None:
    """Refuse custom resources (``rollouts.actor_resources``, ``backend.worker_resources``,
    ``backend.main_resources``) the cluster does not
    offer in the amount asked: an actor waiting for them would stay pending forever, after the other actors had
    started. Totals over the cluster are checked, not which node holds them."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            if key not in ("CPU", "GPU"):
                need[key] = need.get(key, 0.0) + float(amount)
    short = {k: v for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}
    if not short:
        return
    offered = {
        k: v
        for k, v in sorted(have.items())
        if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:")
    }
    missing = ", ".join(f"{k} = {v:g} ({where} has {have.get(k, 0.0):g})" for k, v in sorted(short.items()))
    raise ConfigError(
        f"the placement cannot be satisfied: {SETTINGS_NAMES} ask for {missing}; the custom resources "
        f"{where} offers: {offered or 'none'}",
        hint="start nodes that offer them (ray start --resources='{\"node_a\": 1}') and set "
        "RAY_ADDRESS to the cluster, or change the tables",
    )


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
        """Write the HF folder (weights as they are now) and the trainer state (tensors and plain values only)."""
        path = pathlib.Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.learner.save_pretrained(path)
        save_trainer_state((state or self.get_state())["trainer"], path / TRAINER_STATE_FILE)
        return str(path)

    def restore_from_path(self, path, *, component=None, filesystem=None, **kwargs) -> None:
        """Load weights in place (the in-process engine may share the module) and the trainer state, unpickling
        nothing but tensors and plain values."""
        path = pathlib.Path(path)
        self.learner.load_pretrained(path)
        self.learner.set_state(load_trainer_state(path / TRAINER_STATE_FILE))


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
