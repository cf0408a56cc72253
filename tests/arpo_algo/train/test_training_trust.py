"""Training you can trust: no step on rounding noise, the limit EOS, the rollout/learner mismatch alarm."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from arpo_algo.algorithms.stabilizers import has_signal
from arpo_algo.rollout.diagnostics import group_diagnostics
from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_base.errors import ConfigError
from tests.arpo_algo.train.test_tree_forward import make_groups

BASE = LearnerConfig(lr=1e-3, grad_clip=0.0, micro_batch_tokens=100_000)


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    return make_groups(AutoTokenizer.from_pretrained(tiny_model_dir))


def _with_rewards(g, rewards):
    trajs = [replace(t, traj_id=i, reward=r) for i, (t, r) in
             enumerate(zip((g.trajectories * len(rewards))[:len(rewards)], rewards))]
    return replace(g, trajectories=trajs)


def test_equal_non_binary_rewards_are_no_signal_everywhere(tiny_model_dir, groups):
    """Six trajectories rewarded 1.1 (answer plus format bonus): their GRPO advantages in float are ~2e-10, not 0.
    The learner must not step on that (AdamW would normalise it into a full-size update), and dynamic sampling and
    the diagnostics must call such a group signal-free by the same rule."""
    flat = _with_rewards(groups[0], [1.1] * 6)
    learner = Learner(tiny_model_dir, BASE, seed=0)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    m = learner.update([flat])
    assert m["skipped_no_signal"] == 1 and learner.step == 0
    assert all(torch.equal(before[n], p) for n, p in learner.model.named_parameters())
    rounded = _with_rewards(groups[0], [1.1, math.nextafter(1.1, 2.0)])  # equal rewards that differ in the last bit
    assert rounded.trajectories[0].reward != rounded.trajectories[1].reward
    assert not has_signal(rounded) and not has_signal(flat)
    assert group_diagnostics([rounded])["diag/zero_variance_group_frac"] == 1.0
    assert has_signal(_with_rewards(groups[0], [1.0, 1.0 + 1e-3])) and has_signal(_with_rewards(groups[0], [0.0, 1.0]))


@pytest.mark.parametrize("key, value", [("temperature", 0.7), ("top_p", 0.9), ("top_k", 20)])
def test_sampling_the_learner_cannot_score_is_refused(key, value):
    """The learner scores log_softmax(logits) at temperature 1 over the whole vocabulary; training rollouts sampled
    from another distribution would make every ratio, KL and entropy term off-policy without a word."""
    from arpo_algo.algorithms import ARPOConfig

    cfg = ARPOConfig().training(model_path="unused").llm_rollouts(**{key: value})
    with pytest.raises(ConfigError, match=f"rollouts.{key}={value}") as err:
        cfg.settings.validate()
    assert "learner scores log_softmax" in err.value.hint
    ARPOConfig().training(model_path="unused").evaluation(top_p=0.9).settings.validate()  # evaluation may truncate
