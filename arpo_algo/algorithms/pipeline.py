"""Asynchronous rollouts: the next iteration's trees are sampled in a background thread while the learner updates.

The Algorithm (:meth:`arpo_algo.algorithms.base.AgenticRLAlgorithm.training_step`) drives one
:class:`RolloutPipeline`; one batch is in flight at a time. With ``rollouts.max_staleness = 1``, iteration k (the
learner at version k: k updates applied):

1. takes the batch started in iteration k - 1 (sampled under version k - 1), or samples one now in iteration 0;
2. sends version k's weights to the engine, keeps a copy of them (the snapshot) and starts sampling batch k + 1;
3. updates on batch k, scored under the snapshot of the version that sampled it (the learner's ``behaviour_weights``).

With ``max_staleness = 0`` step 2 happens after the update, with version k + 1: no batch is ever stale, and the update
is the synchronous one (what the tests check). Invariants:

* A tree is sampled under one version: weights reach the engine only while nothing is in flight (:meth:`wait` first).
* A stale batch is scored under the weights that sampled it: a snapshot lives from the push that starts a batch until
  that batch is trained on (at most one, as one batch is in flight).
* The prompt order is the synchronous one (each batch's prompts are drawn in iteration order, in the main thread),
  and a checkpoint records the data position before the batch in flight, which a resumed run samples again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class Batch:
    """One sampled batch and what the learner needs to know about it."""

    groups: list[Any]
    metrics: dict[str, float]
    version: int  # the policy version whose weights sampled it
    sample_s: float  # how long the sampling itself took (in the background thread when asynchronous)


class RolloutPipeline:
    """At most one batch sampling in a background thread, with the snapshot of the weights it is sampled under.

    Args:
        sample: ``sample(indices, step, version) -> (groups, metrics)`` (the sampler; run in the background thread).
        max_staleness: 0 or 1 (:class:`arpo_algo.rollout.config.RolloutsConfig`).
    """

    def __init__(
        self, sample: Callable[[list[int], int, int], tuple[list[Any], dict[str, float]]], max_staleness: int
    ) -> None:
        self._sample = sample
        self.max_staleness = max_staleness
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arpo-rollouts")
        self._pending: Future | None = None
        self._pending_version = -1
        self._prompts_before: dict[str, int] | None = None
        self.snapshots: dict[int, dict[str, Any]] = {}

    def _run(self, indices: list[int], step: int, version: int) -> Batch:
        t0 = time.perf_counter()
        groups, metrics = self._sample(indices, step, version)
        return Batch(groups, metrics, version, time.perf_counter() - t0)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def sample_now(self, indices: list[int], step: int, version: int) -> Batch:
        """Sample in this thread (the first iteration: nothing was started before it)."""
        return self._run(indices, step, version)

    def start(
        self,
        indices: list[int],
        step: int,
        version: int,
        prompts_before: dict[str, int],
        snapshot: dict[str, Any] | None,
    ) -> None:
        """Start sampling ``indices`` under ``version`` (its weights are already on the engine); ``prompts_before``:
        the data position before these prompts were drawn; ``snapshot``: those weights, kept while the batch may be
        trained on by a later version (None when it cannot be: staleness 0)."""
        if self._pending is not None:
            raise RuntimeError("a rollout batch is already in flight")  # the one-version-per-tree invariant
        if snapshot is not None:
            self.snapshots = {version: snapshot}
        self._prompts_before, self._pending_version = prompts_before, version
        self._pending = self._executor.submit(self._run, indices, step, version)

    def take(self) -> Batch:
        """The batch in flight, once it is sampled (its sampling error is raised here)."""
        if self._pending is None:
            raise RuntimeError("no rollout batch is in flight")
        try:
            return self._pending.result()
        finally:
            self._pending, self._prompts_before = None, None

    def wait(self) -> None:
        """Block until the batch in flight (if any) is sampled, keeping it for :meth:`take`: after this the engine
        may be given other weights (evaluation) without changing a tree halfway."""
        if self._pending is not None:
            self._pending.exception()

    def behaviour_weights(self, batch: Batch, learner_version: int) -> dict[str, Any] | None:
        """The weights ``batch`` was sampled under when the learner has moved past them; None when it has not.

        Raises:
            RuntimeError: the batch is stale and its weights were not kept (an invariant of this module broken).
        """
        if batch.version == learner_version:
            return None
        if batch.version not in self.snapshots:
            raise RuntimeError(f"no snapshot of policy version {batch.version} to score a batch sampled under it")
        return self.snapshots[batch.version]

    def prompts_state(self, current: dict[str, int]) -> dict[str, int]:
        """The data position a checkpoint records: before the prompts of the batch in flight, which a resumed run
        samples again (its samples are not in the checkpoint)."""
        return dict(self._prompts_before) if self._prompts_before is not None else current

    def discard(self) -> None:
        """Wait for and drop the batch in flight and every snapshot (a restore replaced the weights and data
        position it was drawn from)."""
        if self._pending is not None:
            self._pending.exception()
        self._pending, self._prompts_before, self.snapshots = None, None, {}

    def close(self) -> None:
        """Let the batch in flight finish (it uses the engine), then stop the thread."""
        self.discard()
        self._executor.shutdown(wait=True)
