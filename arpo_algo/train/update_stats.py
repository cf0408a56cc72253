"""What the learner needs to know about an update before running it: each group's advantages (the one call of the
configured estimator, which the tree recorder repeats), does it carry any signal (an update without one must not
step), the advantage statistics it logs, and the tree-scoped owners of the tree-aware estimators (see
:mod:`arpo_algo.core.advantages`)."""

from __future__ import annotations

from typing import Any

from arpo_algo.core.advantages import ADVANTAGES, TokenAdvantages, episode_advantages, tree_token_owners
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


def group_token_advantages(group: Any, config: Any) -> TokenAdvantages:
    """One group's advantages from the estimator ``config.advantage`` names, with the options it takes: the learner
    trains on exactly these and the tree recorder writes exactly these. An estimator registered ``needs_tree=True``
    gets the group's :func:`tree_owners` under ``hard_scope = "tree"`` and None (shared = identical prefix) under
    ``"tokens"``. A group of recorded episodes (its task lists each trajectory's episode) takes GRPO over its episodes
    (:func:`~arpo_algo.core.advantages.episode_advantages`); the records' settings allow only "grpo" there."""
    episodes = (group.task or {}).get("record_episodes")
    if episodes is not None:
        responses = [t.response_ids for t in group.trajectories]
        return episode_advantages(responses, episodes, group.rewards, norm_by_std=config.norm_adv_by_std)
    estimator = ADVANTAGES.lookup(config.advantage)
    extra: dict[str, Any] = {}
    if ADVANTAGES.meta[config.advantage].get("needs_tree"):
        extra["owners"] = tree_owners(group) if config.hard_scope == "tree" else None
    return estimator(
        group.prompt_ids,
        [t.response_ids for t in group.trajectories],
        [t.trained_mask for t in group.trajectories],
        group.rewards,
        norm_by_std=config.norm_adv_by_std,
        **extra,
    )
