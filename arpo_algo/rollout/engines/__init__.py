"""Rollout engines: token ids in, token ids with logprobs and entropies out (see :mod:`arpo_algo.rollout.engines.base`).

One factory builds every engine: ``build_engine(kind, **settings)`` with ``kind`` one of :data:`ENGINES`
("hf": :class:`~arpo_algo.rollout.engines.hf.engine.HFEngine`,
"vllm": :class:`~arpo_algo.rollout.engines.vllm.engine.VLLMEngine`).
``num_actors > 0`` replicates the engine over that many Ray actors
(:class:`~arpo_algo.rollout.engines.actors.RolloutActorPool`), each building its own copy from ``settings``.
Engine modules are imported only when built, so importing this package does not import torch or vLLM.

Example::

    engine = build_engine("hf", model_or_path="smollm2-135m-instruct", max_batch_size=8)
    pool = build_engine("hf", model_or_path=path, num_actors=2, num_cpus_per_actor=1.0)   # needs ray.init()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from arpo_base.errors import ConfigError
from arpo_base.options import closest


def _hf(**settings: Any) -> Callable[[], Any]:
    from arpo_algo.rollout.engines.hf.engine import HFEngine

    return functools.partial(HFEngine, **settings)


def _vllm(**settings: Any) -> Callable[[], Any]:
    from arpo_algo.rollout.engines.vllm.engine import VLLMEngine

    return functools.partial(VLLMEngine, **settings)


#: Engine kind -> builder: ``builder(**settings)`` returns a picklable zero-argument engine constructor.
ENGINES: dict[str, Callable[..., Callable[[], Any]]] = {"hf": _hf, "vllm": _vllm}


def build_engine(
    kind: str,
    *,
    num_actors: int = 0,
    num_cpus_per_actor: float = 1.0,
    num_gpus_per_actor: float = 0.0,
    actor_resources: tuple[dict[str, float], ...] = (),
    **settings: Any,
) -> Any:
    """Build a :class:`~arpo_algo.rollout.engines.base.RolloutEngine`.

    Args:
        kind: A key of :data:`ENGINES` ("hf" or "vllm").
        num_actors: 0 = the engine in this process; N > 0 = N Ray actors, each with its own engine (needs Ray
            running; a module passed as ``model=`` cannot travel to actors, pass ``model_or_path``).
        num_cpus_per_actor: Ray CPUs per actor.
        num_gpus_per_actor: Ray GPUs per actor.
        actor_resources: Custom resources: one dict for every actor or one per actor (``rollouts.actor_resources``).
        **settings: The engine's own keyword arguments (``HFEngine`` / ``VLLMEngine``).

    Raises:
        ConfigError: Unknown ``kind`` (naming the closest one) or bad settings.
    """
    if kind not in ENGINES:
        close = closest(str(kind), ENGINES)
        raise ConfigError(
            f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}",
            hint=f"did you mean {close!r}?" if close else None,
        )
    if num_actors < 0:
        raise ConfigError(f"num_actors must be >= 0, got {num_actors}")
    factory = ENGINES[kind](**settings)
    if num_actors == 0:
        return factory()
    if "model" in settings:
        raise ConfigError(
            "an engine over a shared module (model=) cannot run in actors",
            hint="pass model_or_path=<folder> with num_actors > 0",
        )
    from arpo_algo.rollout.config import check_custom_resources, per_actor
    from arpo_algo.rollout.engines.actors import RolloutActorPool

    check_custom_resources("actor_resources", actor_resources, num_actors, "num_actors")
    return RolloutActorPool(
        factory,
        num_actors=num_actors,
        num_cpus_per_actor=num_cpus_per_actor,
        num_gpus_per_actor=num_gpus_per_actor,
        resources_per_actor=per_actor(actor_resources, num_actors),
    )


__all__ = ["ENGINES", "build_engine"]
