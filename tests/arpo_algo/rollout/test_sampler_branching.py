"""The tree sampler on the real HF engine with a policy that does call the tool: ARPO branches after tool results,
the tool-limit EOS is recorded as not sampled, and the learner scores the branched trees as the engine sampled them.

The policy is the tiny random Llama taught, in a hundred teacher-forced steps (seconds) on real ToolMath contexts, to
answer every turn with one python call (a scripted policy with real weights, sampled at temperature 1)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from arpo_algo.core.branching import appo_score
from arpo_algo.core.tree import TreeConfig, branch_rng
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


def _first_sampled(t, at: int, k: int, values) -> list[float]:
    """The first ``k`` values of the sampled run that starts at response position ``at`` (the look-ahead)."""
    run = []
    for v, m in zip(values[at:], t.trained_mask[at:]):
        if not m or len(run) == k:
            break
        run.append(v)
    return run


def test_the_appo_policy_records_what_it_scored_and_its_decisions_replay(caller_dir, env_creator):
    k, thr = 4, 0.0021  # the taught tiny policy is near-certain: its scores here lie around 0.002
    tree = TreeConfig(budget=6, initial=2, branch_factor=2, branch_policy="appo", appo_threshold=thr, entropy_tokens=k)
    groups, m = _branch_step(caller_dir, env_creator, tree)
    decisions = [d for g in groups for d in g.decisions]
    assert decisions and len(decisions) == m[MK.BRANCH_CANDIDATES]
    for g in groups:
        by_id = {t.traj_id: t for t in g.trajectories}
        for d in g.decisions:
            t, at = by_id[d["trajectory"]], d["at"]
            assert d["rule"] == "appo" and d["draws"] == [] and t.trained_mask[at - 1] == 0  # after a tool result
            # the gain is re-measured from the recorded trajectory: look-ahead over the last k sampled before
            before = [lp for lp, msk in zip(t.old_logprobs[:at], t.trained_mask[:at]) if msk][-k:]
            after = _first_sampled(t, at, k, t.old_logprobs)
            gain = sum(after) / len(after) - sum(before) / len(before)
            assert d["logprob_gain"] == pytest.approx(gain, abs=1e-9)
            assert d["h_now"] == pytest.approx(sum(_first_sampled(t, at, k, t.entropies)) / len(after), abs=1e-6)
            # the decision replays from the record alone
            assert d["branches"] == (d["cap"] if appo_score(d["h_now"], d["logprob_gain"], 1.0) > thr else 0)
    assert {d["branches"] > 0 for d in decisions} == {True, False}  # selective here: it both branches and declines


def test_random_lookahead_decides_after_the_look_ahead_and_replays_its_draws(caller_dir, env_creator):
    k, rate = 4, 0.5
    tree = TreeConfig(
        budget=6,
        initial=2,
        branch_factor=2,
        branch_policy="random",
        random_rate=rate,
        random_lookahead=True,
        entropy_tokens=k,
    )
    groups, m = _branch_step(caller_dir, env_creator, tree)
    assert m[MK.BRANCH_CANDIDATES] >= 2 and m[MK.BRANCHES] > 0
    for g in groups:
        by_id = {t.traj_id: t for t in g.trajectories}
        draws = [u for d in g.decisions for u in d["draws"]]
        stream = branch_rng(3, 0, g.prompt_index)
        assert draws == [stream.random() for _ in draws]  # the prompt's seeded stream, in order
        for d in g.decisions:
            t, at = by_id[d["trajectory"]], d["at"]
            assert d["branches"] == sum(u < rate for u in d["draws"]) and len(d["draws"]) == d["cap"]
            # asked after the look-ahead: the entropy it saw is the look-ahead's, the clones start at the result
            ahead = _first_sampled(t, at, k, t.entropies)
            assert t.trained_mask[at - 1] == 0 and d["h_now"] == pytest.approx(sum(ahead) / len(ahead), abs=1e-6)
            assert "logprob_gain" not in d
