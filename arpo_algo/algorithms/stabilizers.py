"""Stabilizers for groups without signal, as named options. Each is off by default: the defaults stay the paper's and
the reference's behaviour, and a stabilizer is turned on by name (measured: docs/results/stabilizers.md).

=============================  ==========================================  =============================================
option                         what it does                                source
=============================  ==========================================  =============================================
``dynamic_sampling``           drop groups whose rewards are all equal      DAPO (Yu et al. 2025, arXiv 2503.14476, §3.2
(``.training``)                and sample more prompts until the batch     "Dynamic Sampling"); here with a cap of
                               is full, at most                            ``dynamic_sampling_max_rounds`` sampling
                               ``dynamic_sampling_max_rounds`` rounds      rounds per iteration
``clip_high`` (``.training``)  asymmetric PPO clip, e.g. 0.2 / 0.28        DAPO §3.1 "Clip-Higher"
``loss_agg``                   "token_mean" (DAPO's token-level loss),     DAPO §3.3; Dr. GRPO (Liu et al. 2025, arXiv
                               "seq_mean" (GRPO's per-sequence mean),      2503.20783): no length normalisation (a
                               "dr_grpo" (token sum / (sequences x a       constant denominator) and, with
                               constant)); ``norm_adv_by_std=False``       ``norm_adv_by_std=False``, no std
                               is the other half of Dr. GRPO               normalisation of the advantage
``kl_coef`` (``.training``)    k3 KL to the frozen initial policy          GRPO (Shao et al. 2024); 0 in ARPO/DAPO
``min_roots`` (``.tree``)      branching never takes the budget slots      ours: at M = 4, N = 2 a tree may have only 2
                               that ``min_roots`` independent roots        independent draws; this keeps at least
                               need (fill-ups start them)                  ``min_roots``
``skip_no_signal`` (learner)   always on: an update with no signal is no  a correctness rule, not an option (an AdamW
                               optimizer step                              step on zero gradients still moves weights)
=============================  ==========================================  =============================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from arpo_algo.core.advantages import rewards_have_spread
from arpo_algo.rollout import metrics as MK

if TYPE_CHECKING:
    from arpo_algo.rollout.sampler import TreeSampler

#: Rollout metrics that add up over several sampling rounds (everything else describes the first round).
SUMMED = (
    MK.TOKENS_GENERATED,
    MK.TOKENS_PREFILLED,
    MK.TOKENS_REUSED,
    MK.RESPONSE_TOKENS,
    MK.TOOL_CALLS,
    MK.TRAJECTORIES,
    MK.BRANCHES,
    MK.FILLUPS,
    MK.ENGINE_ERRORS,
    MK.ENV_ERRORS,
    MK.TIME_GENERATE,
    MK.TIME_TOOLS,
    MK.TIME_OVERHEAD,
    MK.TIME_TOTAL,
    MK.STOP_BOUNDARY_CUTS,
    MK.BRANCH_DECISIONS,
    MK.BRANCH_CANDIDATES,
    MK.BRANCH_OPPORTUNITIES,
)
ROUNDS = MK.ROLLOUT + "dynamic_sampling_rounds"
DROPPED = MK.ROLLOUT + "dynamic_sampling_dropped"


def has_signal(group: Any) -> bool:
    """Whether the group's rewards differ beyond rounding (:func:`~arpo_algo.core.advantages.rewards_have_spread`,
    the learner's rule: a group with equal rewards has zero advantages)."""
    return rewards_have_spread([t.reward for t in group.trajectories])


def sample_groups(
    sampler: TreeSampler,
    prompts: Any,
    indices: list[int],
    step: int,
    *,
    dynamic: bool,
    max_rounds: int,
    policy_version: int | None = None,
) -> tuple[list[Any], dict[str, float]]:
    """One iteration's groups: ``sampler.sample(indices)``, and with ``dynamic`` DAPO's dynamic sampling.

    Groups with equal rewards are dropped and ``prompts.next(...)`` draws new prompts for the missing ones (tasks not
    yet drawn in this step), for at most ``max_rounds`` rounds in all. When no group has signal, the first round's
    groups are kept (the learner then skips the update). Every round's tokens and tool calls count in the rollout
    metrics (the budget is honest).
    """
    groups, metrics = sampler.sample(indices, step=step, policy_version=policy_version)
    if not dynamic:
        return groups, metrics
    want, kept, drawn, rounds = len(indices), [g for g in groups if has_signal(g)], len(groups), 1
    used = set(indices)  # a task drawn again in this step would be the same group again (same seeds)
    while len(kept) < want and rounds < max_rounds:
        k = min(want - len(kept), prompts.num_tasks - len(used))
        if k < 1:  # every task of the split is in this step already
            break
        fresh = prompts.next(k, exclude=used)
        used.update(fresh)
        more, m = sampler.sample(fresh, step=step, policy_version=policy_version)
        for k in SUMMED:
            metrics[k] = metrics.get(k, 0.0) + m.get(k, 0.0)
        kept += [g for g in more if has_signal(g)]
        drawn += len(more)
        rounds += 1
    metrics.update(MK.branch_rates(metrics))  # the rates of every drawn group, as the summed counts
    out = kept[:want] if kept else groups
    metrics[ROUNDS], metrics[DROPPED] = float(rounds), float(drawn - len(out))
    return out, metrics
