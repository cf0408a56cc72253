"""Learning diagnostics as standard metrics: every name in one place, so producers, logs and reports agree.

Per training iteration the Algorithm logs :func:`group_diagnostics` of the sampled groups under ``diag/``; the
learner's own numbers come from :meth:`arpo_algo.train.learner.Learner.update` under ``learner/`` (names below).
The run driver writes both sections to TensorBoard and ``metrics.jsonl``. What each says about learning:

* ``diag/zero_variance_group_frac``: groups whose rewards are all equal carry no GRPO gradient.
* ``learner/traj_with_grad_frac``: trajectories with a non-zero advantage on a trained token.
* ``learner/skipped_no_signal``: 1 when the whole update had no signal and was skipped.
* ``diag/distinct_trajectories_per_group``: distinct response token sequences per group (diversity; M at most).
* ``diag/branches_per_group`` and ``diag/branches_after_call_<n>``: where the tree branched (after the n-th tool
  result of the parent; ARPO's claim is that branching pays after tool results).
* ``diag/fillups_per_group``: budget spent on fresh samples instead of branches.
* ``learner/adv_mean``, ``learner/adv_sd``: advantages over trained tokens.
* ``diag/rollout_entropy``: mean entropy of the sampled tokens under the rollout policy; ``learner/entropy``: the
  learner's token-mean entropy (sum-normalised as the loss).
* ``learner/clip_frac``, ``learner/kl_rollout`` (k3 estimate of KL(sampler || learner) on the sampled trained
  tokens before the update's first optimizer step: the mismatch alarm), ``learner/logprob_diff_max``,
  ``learner/grad_norm`` (before clipping), ``learner/param_change_norm``.
* ``diag/reward_<source>``: mean reward per task source (ToolMath level, dataset source).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from arpo_algo.core.advantages import rewards_have_spread
from arpo_algo.rollout import learner_metrics as LK
from arpo_algo.rollout.metrics import mean

PREFIX = "diag/"
ZERO_VARIANCE_GROUP_FRAC = "diag/zero_variance_group_frac"
DISTINCT_TRAJECTORIES = "diag/distinct_trajectories_per_group"
BRANCHES_PER_GROUP = "diag/branches_per_group"
BRANCHES_AFTER_CALL = "diag/branches_after_call_{}"
FILLUPS_PER_GROUP = "diag/fillups_per_group"
ROLLOUT_ENTROPY = "diag/rollout_entropy"
REWARD_BY_SOURCE = "diag/reward_{}"
REWARD_SD_IN_GROUP = "diag/reward_sd_in_group"
# learner-side names (Learner.update's keys, :mod:`.learner_metrics`, as logged under "learner/")
TRAJ_WITH_GRAD = LK.PREFIX + LK.TRAJ_WITH_GRAD_FRAC
SKIPPED_NO_SIGNAL = LK.PREFIX + LK.SKIPPED_NO_SIGNAL
ADV_MEAN, ADV_SD = LK.PREFIX + LK.ADV_MEAN, LK.PREFIX + LK.ADV_SD
POLICY_ENTROPY = LK.PREFIX + LK.ENTROPY
CLIP_FRAC = LK.PREFIX + LK.CLIP_FRAC
KL_ROLLOUT = LK.PREFIX + LK.KL_ROLLOUT
GRAD_NORM = LK.PREFIX + LK.GRAD_NORM
PARAM_CHANGE = LK.PREFIX + LK.PARAM_CHANGE_NORM
STANDARD = (
    ZERO_VARIANCE_GROUP_FRAC,
    DISTINCT_TRAJECTORIES,
    BRANCHES_PER_GROUP,
    FILLUPS_PER_GROUP,
    ROLLOUT_ENTROPY,
    REWARD_SD_IN_GROUP,
    TRAJ_WITH_GRAD,
    SKIPPED_NO_SIGNAL,
    ADV_MEAN,
    ADV_SD,
    POLICY_ENTROPY,
    CLIP_FRAC,
    KL_ROLLOUT,
    GRAD_NORM,
    PARAM_CHANGE,
)


def results_before(mask: list[int], bp: int) -> int:
    """Tool results (runs of ``trained_mask == 0``) that end at or before response position ``bp``."""
    n, prev = 0, 1
    for m in mask[:bp]:
        if m == 0 and prev == 1:
            n += 1
        prev = m
    return n


def source_of(task: dict[str, Any]) -> str:
    """The task's source label for per-source rewards: ``data_source``/``source``, else ``level<n>``, else "all"."""
    for key in ("data_source", "source"):
        if task.get(key):
            return str(task[key])
    return f"level{task['level']}" if "level" in task else "all"


def group_diagnostics(groups: list) -> dict[str, float]:
    """The ``diag/`` metrics of one iteration's groups (see the module docstring)."""
    if not groups:
        return {}
    out: dict[str, float] = {}
    zero, distinct, sds = 0, [], []
    after: Counter[int] = Counter()
    by_source: dict[str, list[float]] = defaultdict(list)
    ents: list[float] = []
    for g in groups:
        rewards = [t.reward for t in g.trajectories]
        zero += not rewards_have_spread(rewards)
        m = mean(rewards)
        sds.append(mean((r - m) ** 2 for r in rewards) ** 0.5)
        distinct.append(len({tuple(t.response_ids) for t in g.trajectories}))
        by_id = {t.traj_id: t for t in g.trajectories}
        for t in g.trajectories:
            by_source[source_of(g.task)].append(t.reward)
            ents.extend(e for e, k in zip(t.entropies, t.trained_mask) if k)
            if t.kind == "branch" and t.parent in by_id and t.branch_point is not None:
                after[results_before(by_id[t.parent].trained_mask, t.branch_point)] += 1
    n = len(groups)
    out[ZERO_VARIANCE_GROUP_FRAC] = zero / n
    out[DISTINCT_TRAJECTORIES] = mean(distinct)
    out[REWARD_SD_IN_GROUP] = mean(sds)
    out[BRANCHES_PER_GROUP] = sum(after.values()) / n
    out[FILLUPS_PER_GROUP] = sum(t.kind == "fillup" for g in groups for t in g.trajectories) / n
    for k, v in sorted(after.items()):
        out[BRANCHES_AFTER_CALL.format(k)] = v / n
    out[ROLLOUT_ENTROPY] = mean(ents)
    for src, rs in sorted(by_source.items()):
        out[REWARD_BY_SOURCE.format(src)] = mean(rs)
    return out
