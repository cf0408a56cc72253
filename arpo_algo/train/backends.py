"""Learner backends behind one interface: the Algorithm builds one with :func:`build_backend` and talks to it only
through :class:`LearnerBackend`.

* ``local`` (:class:`LocalLearner`): the plain :class:`~arpo_algo.train.learner.Learner` in the main process, CPU or
  GPU. It still exposes ``model``, so the in-process rollout engine can share the module.
* ``ddp`` (:class:`arpo_algo.train.ddp.DDPBackend`): one Ray actor per rank, each with a full replica; the groups of
  a step are split across the ranks by tokens and the gradients summed, so the step equals the local one.
* ``deepspeed`` (:class:`arpo_algo.train.deepspeed_learner.DeepSpeedBackend`): the same actors, with the model
  wrapped by ``deepspeed.initialize`` (ZeRO-2/3, gloo on CPU or NCCL on GPU); needs the ``deepspeed`` extra.

``local`` and ``ddp`` keep the learner state (optimizer, scheduler, step counters, RNG) in the layout of
:meth:`Learner.get_state`, so a checkpoint written under one of them restores under the other; ``deepspeed`` keeps
ZeRO's own sharded optimizer state, which restores only into the same stage and number of ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arpo_algo.models.lora import LoraSettings, load_into_learner
from arpo_algo.train.backend_base import LearnerBackend
from arpo_algo.train.backend_config import BackendConfig
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_base.errors import ConfigError

__all__ = ["LearnerBackend", "LocalLearner", "build_backend"]


class LocalLearner(Learner, LearnerBackend):
    """The ``local`` backend: the :class:`Learner` itself, in this process."""

    @property
    def shared_module(self) -> Any:
        return self.model

    def rollout_weights(self) -> dict[str, Any]:
        # with LoRA the adapter tensors only: the frozen base is the same in every copy
        return {k: v.detach().cpu() for k, v in self.trainable_state().items()}

    def load_pretrained(self, path: str | Path) -> None:
        load_into_learner(self, path)


def build_backend(
    model_path: str | Path,
    config: LearnerConfig,
    backend: BackendConfig | None = None,
    *,
    device: str = "cpu",
    seed: int = 0,
    lora: LoraSettings | None = None,
) -> LearnerBackend:
    """The learner backend ``backend.learner_backend`` names, placement checked before any worker starts.

    Raises:
        ConfigError: Bad settings, a placement the cluster cannot hold, or "deepspeed" without the extra.
    """
    backend = backend or BackendConfig()
    backend.validate()
    if backend.learner_backend == "local":
        return LocalLearner(model_path, config, device=device, seed=seed, lora=lora)
    if backend.learner_backend == "ddp":
        from arpo_algo.train.ddp import DDPBackend

        return DDPBackend(model_path, config, backend, device=device, seed=seed, lora=lora)
    if lora is not None and lora.enabled:
        raise ConfigError(
            "model.lora.enabled with backend.learner_backend = 'deepspeed': its ZeRO partitioning is "
            "not wired to the adapter yet",
            hint="use learner_backend = 'local' or 'ddp'",
        )
    from arpo_algo.train.deepspeed_learner import DeepSpeedBackend

    return DeepSpeedBackend(model_path, config, backend, device=device, seed=seed)
