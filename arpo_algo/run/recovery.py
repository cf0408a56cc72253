"""Surviving the loss of a Ray node (or of an actor) during ``arpo train``.

The rule: a training iteration whose actors died is never half-recorded. The run stops the broken algorithm, waits
(bounded) until the cluster again offers what the run asks for, builds a new one, restores it from the newest
checkpoint, and re-runs the iterations after that checkpoint. Their lines in ``metrics.jsonl`` are replaced, so the
file ends with exactly one line per iteration, and every restart is listed in ``result.json`` (``restarts``).

Only losses are retried (an actor or node that died, an object whose owner died, a collective whose peer vanished);
an error raised by our own code in a healthy actor is raised at once. Retries are bounded by
``[experiment] max_restarts`` and the wait for resources by ``restart_wait_s``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from arpo_base.errors import ArpoError
from arpo_base.ray_start import init_ray

log = logging.getLogger(__name__)

#: Words of a collective's error when its peer process died (gloo: the TCP pair was closed or reset).
PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "timed out in call to",
)
POLL_S = 2.0


def is_node_loss(error: BaseException) -> bool:
    """True for the errors that a lost node or actor causes (see the module docstring)."""
    import ray.exceptions as rx

    lost = (
        rx.ActorDiedError,
        rx.ActorUnavailableError,
        rx.NodeDiedError,
        rx.ObjectLostError,
        rx.OwnerDiedError,
        rx.WorkerCrashedError,
        rx.RayActorError,
    )
    if isinstance(error, lost):
        return True
    if isinstance(error, rx.RayTaskError):
        cause = getattr(error, "cause", None)
        if cause is not None and is_node_loss(cause):
            return True
        return any(p in str(error).lower() for p in PEER_LOST)
    return False


def join_cluster() -> bool:
    """Join the cluster ``RAY_ADDRESS`` names (before the placement checks read its resources); True when this call
    started the connection (so the caller shuts it down)."""
    import ray

    if ray.is_initialized() or not os.environ.get("RAY_ADDRESS"):
        return False
    init_ray(log_to_driver=False, logging_level=logging.WARNING)  # RAY_ADDRESS, checked above
    return True


def placement(algo: Any) -> dict[str, Any]:
    """Where the run's actors are: the Ray node of each learner rank and rollout actor, and each node's resources
    (empty when the run uses no Ray)."""
    import ray

    if not ray.is_initialized():
        return {}
    ranks = list(getattr(algo.learner, "rank_nodes", []))
    actors = algo.engine.node_ids() if hasattr(algo.engine, "node_ids") else []
    nodes = {
        n["NodeID"]: {k: v for k, v in n["Resources"].items() if not k.startswith("node:")}
        for n in ray.nodes()
        if n.get("Alive")
    }
    return {
        "driver": ray.get_runtime_context().get_node_id(),
        "learner_ranks": ranks,
        "rollout_actors": actors,
        "nodes": nodes,
    }


def wait_for_resources(config: Any, timeout_s: float) -> None:
    """Until the cluster offers every resource the run asks for (a lost node's come back when it, or a replacement,
    joins); the placement check of the new algorithm then passes. Raises ArpoError naming what is still missing."""
    import ray

    from arpo_algo.algorithms.components import resource_bundles

    need: dict[str, float] = {}
    for bundle in resource_bundles(config)[1:]:  # the main process is this one, and it is alive
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + float(amount)
    deadline = time.monotonic() + timeout_s
    while True:
        have = ray.cluster_resources() if ray.is_initialized() else {}
        short = {k: f"{v:g} (has {have.get(k, 0.0):g})" for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}
        if not short or not ray.is_initialized():
            return
        if time.monotonic() > deadline:
            raise ArpoError(
                f"the cluster did not offer the run's resources again within {timeout_s:g}s after a "
                f"node was lost: missing {short}",
                hint="bring the node (or one with the same --resources) back and --resume the run",
            )
        time.sleep(POLL_S)


def describe(error: BaseException) -> str:
    """One line for an error: a remote task's own exception (not Ray's wrapper), without terminal colours."""
    cause = getattr(error, "cause", None) or error
    lines = [x.strip() for x in re.sub(r"\x1b\[[0-9;]*m", "", str(cause)).splitlines() if x.strip()]
    return f"{type(cause).__name__}: {lines[-1][:300] if lines else ''}"


def record_restart(
    restarts: list[dict[str, Any]], history: list[dict[str, Any]], failed: int, resumed: int, error: BaseException
) -> list[dict[str, Any]]:
    """Add one restart to ``restarts``; returns the history rows the restored checkpoint covers (later rows are
    re-run and written again)."""
    rerun = sorted({h["iteration"] for h in history if h["iteration"] > resumed} | {failed})
    restarts.append(
        {"failed_iteration": failed, "resumed_from": resumed, "rerun_iterations": rerun, "error": describe(error)}
    )
    return [h for h in history if h["iteration"] <= resumed]
