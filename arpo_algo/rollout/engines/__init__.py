"""Rollout engines: token ids in, token ids with logprobs and entropies out (see :mod:`arpo_algo.rollout.engines.base`).

One factory builds every engine: ``build_engine(kind, **settings)`` with ``kind`` a registered engine
(:mod:`arpo_algo.rollout.engines.registry`: each engine's capabilities, settings table and constructor; built in:
"hf", :class:`~arpo_algo.rollout.engines.hf.engine.HFEngine`, and "vllm",
:class:`~arpo_algo.rollout.engines.vllm.engine.VLLMEngine`).
``num_actors > 0`` replicates the engine over that many Ray actors
(:class:`~arpo_algo.rollout.engines.actors.RolloutActorPool`), each building its own copy from ``settings``.
Engine modules are imported only when built, so importing this package does not import torch or vLLM.

Example::

    engine = build_engine("hf", model_or_path="smollm2-135m-instruct", max_batch_size=8)
    pool = build_engine("hf", model_or_path=path, num_actors=2, num_cpus_per_actor=1.0)   # needs ray.init()
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from arpo_algo.rollout.engines.registry import (
    ENGINES,
    EngineCapabilities,
    EngineSpec,
    engine_names,
    engine_spec,
    register_engine,
)
from arpo_base.errors import ConfigError
from arpo_base.options import closest

if TYPE_CHECKING:
    from arpo_algo.rollout.engines.base import RolloutEngine


def build_engine(
    kind: str,
    *,
    num_actors: int = 0,
    num_cpus_per_actor: float = 1.0,
    num_gpus_per_actor: float = 0.0,
    actor_resources: tuple[dict[str, float], ...] = (),
    **settings: Any,
) -> RolloutEngine:
    """Build a :class:`~arpo_algo.rollout.engines.base.RolloutEngine`.

    Args:
        kind: A registered engine's name (:data:`ENGINES`: "hf", "vllm", and any added by
            :func:`~arpo_algo.rollout.engines.registry.register_engine`).
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
    factory = functools.partial(ENGINES[kind].engine_class(), **settings)
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


def __getattr__(name: str) -> Any:
    """``HFEngine`` and ``VLLMEngine``, imported on first use (importing this package imports neither torch nor
    vLLM)."""
    if name in ("HFEngine", "VLLMEngine"):
        return engine_spec("hf" if name == "HFEngine" else "vllm").engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ENGINES",
    "EngineCapabilities",
    "EngineSpec",
    "HFEngine",
    "VLLMEngine",
    "build_engine",
    "engine_names",
    "engine_spec",
    "register_engine",
]
