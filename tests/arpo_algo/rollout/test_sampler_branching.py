"""The tree sampler on the real HF engine with a policy that does call the tool: ARPO branches after tool results,
the tool-limit EOS is recorded as not sampled, and the learner scores the branched trees as the engine sampled them.

The policy is the tiny random Llama taught, in a hundred teacher-forced steps (seconds) on real ToolMath contexts, to
answer every turn with one python call (a scripted policy with real weights, sampled at temperature 1)."""

from __future__ import annotations

import dataclasses
import math

from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout import diagnostics as DIAG
from arpo_algo.rollout import metrics as MK
from arpo_algo.rollout.config import RolloutsConfig
from arpo_algo.rollout.diagnostics import group_diagnostics
from arpo_algo.rollout.engines.hf.engine import HFEngine
from arpo_algo.rollout.sampler import TreeSampler
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_algo.train.learner_config import MISMATCH_LEVELS
from tests.arpo_algo.rollout import teach

env_creator, caller_dir = teach.env_creator, teach.caller_dir  # the module-scoped fixtures, shared


def test_arpo_branches_after_tool_results_on_the_real_engine(caller_dir, env_creator):
    engine = HFEngine(caller_dir, dtype="float32", seed=0)
    tree = TreeConfig(budget=4, initial=2, branch_factor=1, tau=0.4)  # alpha 0.5 > tau: branch after every result
    sampler = TreeSampler.from_config(engine, env_creator, tree, RolloutsConfig(max_response_tokens=240), seed=0)
    try:
        groups, metrics = sampler.sample([0], step=0)
    finally:
        sampler.close()
    trajs = [t for g in groups for t in g.trajectories]
    # sampled at temperature 1, a call may come out garbled now and then; the policy calls the tool all the same
    assert sum(bool(t.tool_calls) for t in trajs) >= 2
    branches = [t for t in trajs if t.kind == "branch"]
    assert branches and metrics["rollout/branches"] == len(branches)
    for g in groups:
        by_id = {t.traj_id: t for t in g.trajectories}
        for t in g.trajectories:
            if t.kind != "branch":
                continue
            parent, bp = by_id[t.parent], t.branch_point
            assert t.response_ids[:bp] == parent.response_ids[:bp]  # the inherited prefix, not re-sampled
            assert parent.trained_mask[bp - 1] == 0 and t.trained_mask[bp] == 1  # right after a tool result
    limited = [t for t in trajs if t.finish_reason == "tool_limit"]
    assert all(math.isnan(t.old_logprobs[-1]) and t.trained_mask[-1] == 1 for t in limited)
    assert all(t.unsampled == ([len(t.response_ids) - 1] if t in limited else []) for t in trajs)
    # The learner scores the branched trees (hard attribution, rollout old log-probs) as the engine sampled them.
    learner = Learner(caller_dir, LearnerConfig(advantage="hard", old_logprobs="rollout"), seed=0)
    m = learner.update(groups)
    assert m["kl_rollout"] < MISMATCH_LEVELS["fp32"][0] and m["logprob_diff_max"] < 1e-3


def _branch_step(caller_dir, env_creator, tree):
    engine = HFEngine(caller_dir, dtype="float32", seed=0)
    sampler = TreeSampler.from_config(engine, env_creator, tree, RolloutsConfig(max_response_tokens=160), seed=3)
    try:
        groups, metrics = sampler.sample([0, 1], step=0)
    finally:
        sampler.close()
    return groups, {**metrics, **group_diagnostics(groups)}  # the step's rollout metrics and its diagnostics


def test_a_step_measures_branches_per_candidate_opportunity_and_group(caller_dir, env_creator):
    rates = (MK.BRANCHES_PER_CANDIDATE, MK.BRANCHES_PER_OPPORTUNITY, DIAG.BRANCHES_PER_GROUP)
    _, m = _branch_step(caller_dir, env_creator, TreeConfig.grpo(4))  # the never policy
    assert [m[k] for k in (MK.BRANCHES, *rates)] == [0.0] * 4
    random_tree = TreeConfig(budget=6, initial=2, branch_factor=2, branch_policy="random")
    _, m = _branch_step(caller_dir, env_creator, dataclasses.replace(random_tree, random_rate=0.0))
    assert m[MK.BRANCH_CANDIDATES] >= 2 and [m[k] for k in (MK.BRANCHES, *rates)] == [0.0] * 4  # offered, none taken
    groups, m = _branch_step(caller_dir, env_creator, dataclasses.replace(random_tree, random_rate=1.0))
    decisions = [d for g in groups for d in g.decisions]
    caps = [d["cap"] for d in decisions]
    assert 2 in caps and len(decisions) == m[MK.BRANCH_CANDIDATES] == m[MK.BRANCH_DECISIONS]
    # rate 1 makes every clone the cap allows: branches per candidate is the (mean) cap, per opportunity 1
    assert m[MK.BRANCHES] == m[MK.BRANCH_OPPORTUNITIES] == sum(caps)
    assert m[MK.BRANCHES_PER_CANDIDATE] == sum(caps) / len(caps) and m[MK.BRANCHES_PER_OPPORTUNITY] == 1.0
    assert m[DIAG.BRANCHES_PER_GROUP] == sum(caps) / len(groups)
    for g in groups:  # the per-group counts the rates are made of
        assert g.metrics[MK.GROUP_BRANCH_CANDIDATES] == len(g.decisions)
        assert (
            g.metrics[MK.GROUP_BRANCHES]
            == g.metrics[MK.GROUP_BRANCH_OPPORTUNITIES]
            == sum(d["cap"] for d in g.decisions)
        )
