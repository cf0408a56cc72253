"""Stabilizers as named options: dynamic sampling, min_roots, Dr. GRPO loss aggregation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from arpo_algo.algorithms.components import PromptIterator
from arpo_algo.algorithms.stabilizers import DROPPED, ROUNDS, sample_groups
from arpo_algo.core.tree import TreeConfig
from arpo_algo.rollout import metrics as MK
from arpo_algo.rollout.engines.base import SamplingParams
from arpo_algo.rollout.sampler import TreeSampler
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_algo.train.learner_config import ALARM_OFF
from arpo_base.errors import ConfigError
from arpo_env.core import ToolTextEnv
from tests.arpo_algo.rollout.test_sampler import ScriptedEngine
from tests.arpo_algo.train.test_tree_forward import make_groups


@pytest.fixture()
def env_creator(tmp_path):
    return lambda: ToolTextEnv(task="toolmath", tools={"python": {}, "cache": {"path": str(tmp_path / "c.sqlite")}})


def test_dynamic_sampling_draws_more_prompts_up_to_the_cap(env_creator):
    # every trajectory calls tools past the limit: reward 0 everywhere, no group has signal
    eng = ScriptedEngine(calls=(9, 9))
    s = TreeSampler(eng, env_creator, TreeConfig.grpo(2), SamplingParams(), max_response_tokens=400)
    it = PromptIterator(num_tasks=50, seed=0)
    groups, m = sample_groups(s, it, it.next(2), 0, dynamic=True, max_rounds=3)
    assert m[ROUNDS] == 3 and m[DROPPED] == 4 and len(groups) == 2  # no signal anywhere: the first round's groups
    assert m["num_trajectories"] == 12 and m["rollout/tool_calls"] == 12 * 4  # every round counts in the budget
    assert it.get_state()["position"] == 6
    it2 = PromptIterator(num_tasks=50, seed=0)
    _, m2 = sample_groups(s, it2, it2.next(2), 0, dynamic=False, max_rounds=3)
    assert ROUNDS not in m2 and m2["num_trajectories"] == 4 and it2.get_state()["position"] == 2


def test_dynamic_sampling_never_draws_a_task_twice_in_a_step(env_creator):
    # 3 tasks, 2 prompts a step, no signal anywhere: a second round may draw only the one task not yet in the step
    # (drawn again, a task gives the same group: the seeds depend on the step and the task)
    eng = ScriptedEngine(calls=(9, 9))
    s = TreeSampler(eng, env_creator, TreeConfig.grpo(2), SamplingParams(), max_response_tokens=400)
    asked: list[list[int]] = []

    class Recording:
        def sample(self, indices, **kw):
            asked.append(list(indices))
            return s.sample(indices, **kw)

    it = PromptIterator(num_tasks=3, seed=0)
    groups, m = sample_groups(Recording(), it, it.next(2), 0, dynamic=True, max_rounds=4)
    drawn = [i for a in asked for i in a]
    assert sorted(drawn) == [0, 1, 2] and len(asked) == 2 and m[ROUNDS] == 2 and len(groups) == 2


def test_min_roots_keeps_budget_for_independent_roots(env_creator):
    eng = ScriptedEngine(calls=(2, 2), entropy=lambda n, v: 1.0 + n)  # entropy rises: the paper rule always branches
    for min_roots, roots in ((0, 2), (3, 3), (4, 4)):
        cfg = TreeConfig(budget=4, initial=2, branch_factor=1, entropy_tokens=10, min_roots=min_roots)
        groups, _ = TreeSampler(eng, env_creator, cfg, SamplingParams(), max_response_tokens=400).sample([0, 1], 0)
        assert len(groups) == 2  # one per prompt: the loop below checks both
        for g in groups:
            assert len(g.trajectories) == 4 and sum(t.parent is None for t in g.trajectories) == roots
    with pytest.raises(ConfigError, match="min_roots"):
        TreeConfig(budget=4, initial=2, min_roots=5).validate()


def test_dr_grpo_aggregation_is_token_sum_over_a_constant(tiny_model_dir):
    groups = make_groups(AutoTokenizer.from_pretrained(tiny_model_dir))
    base = LearnerConfig(
        lr=1e-3, grad_clip=0.0, micro_batch_tokens=100_000, dedup_prefix=False, **ALARM_OFF
    )  # hand-built behaviour log-probs
    grads = {}
    for agg in ("token_mean", "dr_grpo"):
        learner = Learner(tiny_model_dir, replace(base, loss_agg=agg, dr_grpo_tokens=50), seed=0)
        learner.update(groups)
        grads[agg] = learner.model.lm_head.weight.grad.clone()
    trained = sum(sum(t.trained_mask) for g in groups for t in g.trajectories)
    n_seq = sum(len(g.trajectories) for g in groups)
    torch.testing.assert_close(grads["dr_grpo"], grads["token_mean"] * trained / (n_seq * 50), rtol=1e-4, atol=1e-7)


def test_dynamic_sampling_rates_are_over_every_drawn_group(env_creator):
    # no signal anywhere: three rounds of two groups each, every one branching at every opportunity (rate 1)
    tree = TreeConfig(budget=4, initial=2, branch_factor=1, branch_policy="random", random_rate=1.0)
    s = TreeSampler(ScriptedEngine(calls=(9, 9)), env_creator, tree, SamplingParams(), max_response_tokens=400)
    it = PromptIterator(num_tasks=50, seed=0)
    groups, m = sample_groups(s, it, it.next(2), 0, dynamic=True, max_rounds=3)
    assert m[ROUNDS] == 3 and len(groups) == 2 and m[MK.BRANCHES] == m[MK.BRANCH_OPPORTUNITIES] == 6 * 2
    assert m[MK.BRANCHES_PER_OPPORTUNITY] == 1.0
    assert m[MK.BRANCHES_PER_CANDIDATE] == m[MK.BRANCHES] / m[MK.BRANCH_CANDIDATES]
