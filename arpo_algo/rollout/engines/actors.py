"""RolloutActorPool: the same engine as N Ray actors behind the :class:`RolloutEngine` interface.

Requests are spread over the actors (fewest requests first). A request with a ``prefix_key`` goes to the actor that
produced that key, because only that actor holds the KV cache (a sticky ``cache_key -> actor`` map; cache keys of
:class:`~arpo_algo.rollout.engines.hf.engine.HFEngine` carry a per-engine unique id, so
keys never collide across actors).
Weights are broadcast with one ``ray.put`` and a ``load_state_dict`` call per actor.

Example::

    ray.init(num_cpus=2, include_dashboard=False)
    pool = RolloutActorPool(functools.partial(HFEngine, "/path/to/model", max_batch_size=8), num_actors=2,
                            num_cpus_per_actor=1)
    gens = pool.generate(requests)
    pool.load_state_dict(learner.model.state_dict())
    pool.close()
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from arpo_algo.rollout.engines.base import Generation, GenRequest, TokenCallback, replay_tokens
from arpo_base.errors import ArpoError, ConfigError

MAX_TRACKED_KEYS = 200_000  # bound on the sticky map; a dropped entry only costs a full prefill later


class _EngineActor:
    """Runs one engine inside a Ray actor process."""

    def __init__(self, engine_factory: Callable[[], Any], num_threads: int) -> None:
        import torch

        # Ray sets OMP_NUM_THREADS from num_cpus; torch's intra-op pool must follow or actors oversubscribe the cores.
        torch.set_num_threads(num_threads)
        self.engine = engine_factory()

    def generate(self, requests: list[GenRequest]) -> list[Generation]:
        return self.engine.generate(requests)

    def release(self, cache_keys: list[Any]) -> None:
        self.engine.release(cache_keys)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_max_context(self) -> int | None:
        return self.engine.max_context

    def get_max_logprobs(self) -> int:
        return self.engine.max_logprobs

    def close(self) -> None:
        self.engine.close()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RolloutActorPool:
    """N engine replicas as Ray actors, with the :class:`~arpo_algo.rollout.engines.base.RolloutEngine` interface.

    Args:
        engine_factory: A picklable zero-argument callable that builds the engine inside the actor
            (e.g. ``functools.partial(HFEngine, model_path, max_batch_size=8)``).
        num_actors: Number of replicas.
        num_cpus_per_actor: Ray CPU resource per actor (fractions allowed: 0.5 fits 2 actors on 1 core); torch in
            each actor uses ``max(1, int(num_cpus_per_actor))`` threads.
        num_gpus_per_actor: Ray GPU resource per actor (0 on CPU machines).
        resources_per_actor: Ray custom resources of each actor (one dict per actor), which place it on the nodes
            that offer them.

    Raises:
        ArpoError: Ray is not initialised.
    """

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        num_actors: int = 2,
        num_cpus_per_actor: float = 1.0,
        *,
        num_gpus_per_actor: float = 0.0,
        resources_per_actor: list[dict[str, float]] | None = None,
    ) -> None:
        import ray

        if num_actors < 1 or num_cpus_per_actor < 0 or num_gpus_per_actor < 0:
            raise ConfigError(
                f"num_actors must be >= 1 and resources >= 0, got {num_actors}, {num_cpus_per_actor}, "
                f"{num_gpus_per_actor}"
            )
        if not ray.is_initialized():
            raise ArpoError("RolloutActorPool needs a running Ray", hint="call ray.init(...) before building the pool")
        actor_cls = ray.remote(num_cpus=num_cpus_per_actor, num_gpus=num_gpus_per_actor)(_EngineActor)
        threads = max(1, int(num_cpus_per_actor))
        custom = resources_per_actor or [{} for _ in range(num_actors)]
        if len(custom) != num_actors:
            raise ConfigError(f"resources_per_actor has {len(custom)} dicts for {num_actors} actors")
        # Actor handles: Ray's type hints do not model the `.remote` of an actor's methods, so they stay untyped.
        self._actors: list[Any] = [
            actor_cls.options(resources=res).remote(engine_factory, threads)
            if res
            else actor_cls.remote(engine_factory, threads)
            for res in custom
        ]
        self._owner: collections.OrderedDict[Any, int] = collections.OrderedDict()
        self._tokenizer: Any = None
        self._max_context: Any = ...  # fetched once
        self._max_logprobs: int | None = None  # fetched once
        self._next = 0

    @property
    def num_actors(self) -> int:
        return len(self._actors)

    def node_ids(self) -> list[str]:
        """The Ray node of each actor, in actor order."""
        import ray

        return ray.get([a.node_id.remote() for a in self._actors])

    @property
    def tokenizer(self) -> Any:
        """The engines' tokenizer (fetched once from the first actor)."""
        if self._tokenizer is None:
            import ray

            self._tokenizer = ray.get(self._actors[0].get_tokenizer.remote())
        return self._tokenizer

    @property
    def max_context(self) -> int | None:
        """The engines' context limit (fetched once from the first actor)."""
        if self._max_context is ...:
            import ray

            self._max_context = ray.get(self._actors[0].get_max_context.remote())
        return self._max_context

    @property
    def max_logprobs(self) -> int:
        """The engines' limit of top logprobs per token (fetched once from the first actor)."""
        if self._max_logprobs is None:
            import ray

            self._max_logprobs = ray.get(self._actors[0].get_max_logprobs.remote())
        return self._max_logprobs

    def generate(self, requests: list[GenRequest], *, on_token: TokenCallback | None = None) -> list[Generation]:
        """Continue every request on some actor (prefix requests on the actor holding the cache); request order.
        Actors do not stream: ``on_token`` is called for each token once the call returns."""
        import ray

        buckets: list[list[int]] = [[] for _ in self._actors]
        for i, req in enumerate(requests):
            owner = self._owner.get(req.prefix_key) if req.prefix_key is not None else None
            if owner is None:
                # least-loaded actor; the rotating start spreads single requests over the actors between calls
                order = [(self._next + j) % len(self._actors) for j in range(len(self._actors))]
                owner = min(order, key=lambda a: len(buckets[a]))
            buckets[owner].append(i)
        self._next = (self._next + 1) % len(self._actors)
        calls = [
            (a, idx, self._actors[a].generate.remote([requests[i] for i in idx]))
            for a, idx in enumerate(buckets)
            if idx
        ]
        results: list[Generation | None] = [None] * len(requests)
        for a, idx, ref in calls:
            for i, gen in zip(idx, ray.get(ref)):
                results[i] = gen
                if gen.cache_key is not None:
                    self._owner[gen.cache_key] = a
        while len(self._owner) > MAX_TRACKED_KEYS:
            self._owner.popitem(last=False)
        replay_tokens(on_token, results)  # type: ignore[arg-type]
        return results  # type: ignore[return-value]

    def release(self, cache_keys: list[Any]) -> None:
        """Drop these cached KV states on the actors that hold them."""
        import ray

        per_actor: dict[int, list[Any]] = collections.defaultdict(list)
        for key in cache_keys:
            owner = self._owner.pop(key, None)
            if owner is not None:
                per_actor[owner].append(key)
        ray.get([self._actors[a].release.remote(keys) for a, keys in per_actor.items()])

    def broadcast(self, state_dict: dict[str, Any]) -> None:
        """Send new weights to every actor: one ``ray.put`` of CPU tensors, then ``load_state_dict`` on each."""
        import ray

        cpu = {k: v.detach().to("cpu") if hasattr(v, "detach") else v for k, v in state_dict.items()}
        ref = ray.put(cpu)
        ray.get([a.load_state_dict.remote(ref) for a in self._actors])
        self._owner.clear()  # the engines dropped their KV caches (computed with the old weights)

    load_state_dict = broadcast

    def stats(self) -> dict[str, float]:
        """Counters summed over the actors since the last call."""
        import ray

        total: collections.Counter[str] = collections.Counter()
        for s in ray.get([a.stats.remote() for a in self._actors]):
            total.update(s)
        return dict(total)

    def close(self) -> None:
        """Kill the actors (the pool cannot be used afterwards). Idempotent."""
        if not self._actors:
            return
        import ray

        try:  # let each engine stop its own processes first (vLLM's engine core), then kill the actors
            ray.get([a.close.remote() for a in self._actors], timeout=60)
        except Exception:  # noqa: BLE001 - a dead or hung actor is killed below all the same
            pass
        for a in self._actors:
            ray.kill(a)
        self._actors = []
        self._owner.clear()

    shutdown = close  # the name before the engine interface had close()
