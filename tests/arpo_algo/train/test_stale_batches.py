"""A batch sampled by an earlier policy version (asynchronous rollouts) is scored under that version's weights: the
mismatch alarm stays quiet on legitimate staleness and still stops on an engine that holds other weights."""

from __future__ import annotations

import pytest
import torch

from arpo_algo.train.learner import Learner, LearnerConfig
from arpo_base.errors import ArpoError

ALARM = r"KL\(sampler \|\| learner\) = .* above training.kl_rollout_stop"


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def test_a_stale_batch_is_scored_under_the_version_that_sampled_it(tiny_model_dir, tmp_path):
    """A real HF engine with its own weights (as a rollout actor holds) samples two batches under version 0; the
    learner trains on the first (version 1). The second batch, one version behind, stops the run when scored with the
    current weights and trains when scored under version 0's weights, which are swapped back bitwise. A batch that an
    engine still at version 0 sampled while version 1 was declared stops the run: staleness does not hide a real
    mismatch."""
    from arpo_algo.core.tree import TreeConfig
    from arpo_algo.rollout.config import RolloutsConfig
    from arpo_algo.rollout.engines.hf.engine import HFEngine
    from arpo_algo.rollout.sampler import TreeSampler
    from arpo_algo.train.learner_config import MISMATCH_LEVELS
    from arpo_env.core import ToolTextEnv

    tools = {"python": {}, "cache": {"path": str(tmp_path / "c.sqlite")}}
    engine = HFEngine(tiny_model_dir, dtype="float32", seed=0)
    sampler = TreeSampler.from_config(
        engine,
        lambda: ToolTextEnv(task="toolmath", tools=tools),
        TreeConfig.grpo(2),
        RolloutsConfig(max_response_tokens=16),
        seed=0,
    )
    # the entropy bonus always has a gradient, so every update is a real step even when the rewards are equal
    learner = Learner(tiny_model_dir, LearnerConfig(lr=3e-2, micro_batch_tokens=100_000, entropy_coef=0.01), seed=0)
    warn, _ = MISMATCH_LEVELS["fp32"]
    try:
        v0 = _weights(learner)
        first, _ = sampler.sample([0], step=0, policy_version=0)
        in_flight, _ = sampler.sample([1], step=1, policy_version=0)
        assert {t.policy_version for t in in_flight[0].trajectories} == {0}
        assert {n.policy_version for n in in_flight[0].nodes} == {0} and in_flight[0].policy_version == 0
        assert learner.update(first)["kl_rollout"] < warn and learner.step == 1  # version 1
        v1 = _weights(learner)
        with pytest.raises(ArpoError, match=ALARM) as stale:  # scored with version 1: staleness looks like a mismatch
            learner.update(in_flight)
        assert "behaviour_weights" in stale.value.hint  # the hint names the way to score a stale batch
        assert all(torch.equal(v1[k], v) for k, v in learner.model.state_dict().items())
        m = learner.update(in_flight, behaviour_weights=v0)
        assert m["kl_rollout"] < warn and m["logprob_diff_max"] < 1e-3 and learner.step == 2  # version 2
        assert m["param_change_norm"] > 0
        # the swap left the stepped weights in place: they are version 1's plus this step, not version 0's
        assert not all(torch.equal(v0[k], v) for k, v in learner.model.state_dict().items())
        # version 1 declared, but the engine was never sent it: it still samples with version 0
        wrong, _ = sampler.sample([2], step=2, policy_version=1)
        before = _weights(learner)
        with pytest.raises(ArpoError, match=ALARM) as e:
            learner.update(wrong, behaviour_weights=v1)
        assert "stale weights" in e.value.hint and learner.step == 2
        assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
        engine.load_state_dict(v1)  # the engine now holds the declared version
        right, _ = sampler.sample([2], step=2, policy_version=1)
        assert learner.update(right, behaviour_weights=v1)["kl_rollout"] < warn
    finally:
        sampler.close()
