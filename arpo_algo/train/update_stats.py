"""What the learner needs to know about an update before running it: does it carry any signal (an update without
one must not step), the advantage statistics it logs, and the tree-scoped owners of hard attribution (see
:mod:`arpo_algo.core.advantages`)."""

from __future__ import annotations

from typing import Any

from arpo_algo.core.advantages import tree_token_owners
from arpo_algo.rollout import learner_metrics as LK


def signal_stats(seqs: list[Any]) -> tuple[bool, dict[str, float]]:
    """``(any trained token has a non-zero advantage, metrics)`` for the update's :class:`SeqSpec` list."""
    with_grad = [any(a != 0.0 and m for a, m in zip(s.adv, s.trained)) for s in seqs]
    advs = [a for s in seqs for a, m in zip(s.adv, s.trained) if m]
    mean = sum(advs) / len(advs) if advs else 0.0
    sd = (sum((a - mean) ** 2 for a in advs) / len(advs)) ** 0.5 if advs else 0.0
    return any(with_grad), {
        LK.TOKENS: float(sum(len(s.prompt) + len(s.response) for s in seqs)),
        LK.TRAINED_TOKENS: float(sum(sum(s.trained) for s in seqs)),
        LK.TRAJ_WITH_GRAD_FRAC: sum(with_grad) / max(len(seqs), 1),
        LK.SKIPPED_NO_SIGNAL: 0.0,
        LK.ADV_MEAN: mean,
        LK.ADV_SD: sd,
    }


def tree_owners(group: Any) -> list[list[int]]:
    """Per trajectory and response token, the trajectory that sampled it (hard attribution's "tree" scope)."""
    trajs = group.trajectories
    return tree_token_owners(
        [t.parent for t in trajs], [t.branch_point for t in trajs], [len(t.response_ids) for t in trajs]
    )
