"""The tree sampler on the real HF engine with a policy that does call the tool: ARPO branches after tool results,
the tool-limit EOS is recorded as not sampled, and the learner scores the branched trees as the engine sampled them.

The policy is the tiny random Llama taught, in a hundred teacher-forced steps (seconds) on real ToolMath contexts, to
answer every turn with one python call (a scripted policy with real weights, sampled at temperature 1)."""

from __future__ import annotations

import math

from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout.config import RolloutsConfig
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
