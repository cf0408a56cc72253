"""The worked example ``examples/extend/branch_policy.py``: one class and one registration line make a branch-point
policy that ``tree.branch_policy`` selects, and a real seeded sampler step on the tiny model branches where its draws
say."""

from __future__ import annotations

import pytest

from arpo_algo.core.branching import BRANCH_POLICIES
from arpo_algo.core.tree import TreeConfig, branch_policy, branch_rng, num_branches
from arpo_algo.rollout.config import RolloutsConfig
from arpo_algo.rollout.engines.hf import HFEngine
from arpo_algo.rollout.sampler import TreeSampler
from arpo_base.errors import ConfigError
from examples.extend.branch_policy import FixedRateDemo
from tests.arpo_algo.rollout import teach

env_creator, caller_dir = teach.env_creator, teach.caller_dir  # the module-scoped fixtures, shared


def test_the_registration_line_makes_it_selectable_by_name():
    assert BRANCH_POLICIES["fixed_rate_demo"] is FixedRateDemo
    cfg = TreeConfig(branch_policy="fixed_rate_demo")
    assert cfg.policy_name == "fixed_rate_demo" and isinstance(branch_policy(cfg), FixedRateDemo)
    with pytest.raises(ConfigError, match="not a registered branch policy") as err:
        TreeConfig(branch_policy="fixed_rate_dmeo").validate()
    assert "did you mean 'fixed_rate_demo'?" in err.value.hint


def test_it_branches_at_its_fixed_rate_on_the_seeded_stream():
    cfg = TreeConfig(branch_factor=1, branch_policy="fixed_rate_demo")
    rng, replay = branch_rng(3, 1, 2), branch_rng(3, 1, 2)
    made = [num_branches(cfg, 0.0, 0, 0, 1, rng) for _ in range(20_000)]
    assert made == [int(replay.random() < FixedRateDemo.rate) for _ in made]  # one draw per candidate, in order
    sd = (FixedRateDemo.rate * (1 - FixedRateDemo.rate) / len(made)) ** 0.5
    assert abs(sum(made) / len(made) - FixedRateDemo.rate) < 4 * sd
    # the frame still holds: no branch past the depth limit or the budget, and the policy is not even asked there
    assert (
        num_branches(TreeConfig(branch_factor=1, branch_policy="fixed_rate_demo", max_depth=1), 0.0, 1, 0, 1, None) == 0
    )
    assert num_branches(cfg, 0.0, 0, 0, 0, None) == 0


def _step(caller_dir, env_creator, seed):
    engine = HFEngine(caller_dir, dtype="float32", seed=0)
    tree = TreeConfig(budget=8, initial=2, branch_factor=1, branch_policy="fixed_rate_demo")
    sampler = TreeSampler.from_config(engine, env_creator, tree, RolloutsConfig(max_response_tokens=240), seed=seed)
    try:
        return sampler.sample([0, 1], step=0)
    finally:
        sampler.close()


def test_a_seeded_sampler_step_branches_where_its_draws_say(caller_dir, env_creator):
    groups, metrics = _step(caller_dir, env_creator, seed=5)
    decisions = [d for g in groups for d in g.decisions]
    assert len(decisions) == metrics["rollout/branch_decisions"] >= 4
    assert sum(d["branches"] for d in decisions) == metrics["rollout/branches"] > 0
    for g in groups:
        assert len(g.trajectories) == 8
        # the decisions consumed the prompt's seeded branch stream in order, one draw per possible clone
        draws = [u for d in g.decisions for u in d["draws"]]
        stream = branch_rng(5, 0, g.prompt_index)
        assert draws == [stream.random() for _ in draws]
        for d in g.decisions:
            assert d["rule"] == "fixed_rate_demo" and d["branches"] == sum(u < FixedRateDemo.rate for u in d["draws"])
            clones = [t for t in g.trajectories if t.parent == d["trajectory"] and t.branch_point == d["at"]]
            assert len(clones) == d["branches"]  # each clone starts where its decision was taken
        parents = {t.traj_id: t for t in g.trajectories}
        for t in g.trajectories:
            if t.kind == "branch":  # right after a tool result, on the parent's own tokens
                assert t.response_ids[: t.branch_point] == parents[t.parent].response_ids[: t.branch_point]
                assert parents[t.parent].trained_mask[t.branch_point - 1] == 0
