"""The interface every learner backend implements (:mod:`arpo_algo.train.backends` lists them)."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any

from arpo_algo.rollout.types import Group

__all__ = ["LearnerBackend"]


class LearnerBackend(abc.ABC):
    """What the Algorithm needs from a learner, wherever it runs."""

    tokenizer: Any
    #: Optimizer steps taken (rank 0's counter for data-parallel backends).
    step: int

    @abc.abstractmethod
    def update(self, groups: list[Group]) -> dict[str, float]:
        """One learner update on ``groups`` (see :meth:`Learner.update`); the metrics of the whole step."""

    @abc.abstractmethod
    def get_state(self, *, include_model: bool = False) -> dict[str, Any]:
        """Optimizer, scheduler, counters and RNG (rank 0's), in :meth:`Learner.get_state`'s layout."""

    @abc.abstractmethod
    def set_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`get_state`'s dict on every rank."""

    @abc.abstractmethod
    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write rank 0's weights as a plain Hugging Face folder (with the tokenizer)."""

    @abc.abstractmethod
    def load_pretrained(self, path: str | Path) -> None:
        """Load the weights of a Hugging Face folder in place, on every rank."""

    @abc.abstractmethod
    def rollout_weights(self) -> dict[str, Any]:
        """Rank 0's weights as CPU tensors, for a rollout engine that holds its own copy."""

    @property
    def shared_module(self) -> Any | None:
        """The live policy module when it is in this process (an in-process engine can share it), else None."""
        return None

    def close(self) -> None:  # noqa: B027 - optional: only backends with workers have something to stop
        """Stop the workers, if any (idempotent)."""
