"""The branch-point policy seam: each algorithm's rules are registered policies, one setting picks each, and the
frame around a policy (budget, depth, clip to [0, cap]) holds for any policy."""

from __future__ import annotations

import math
import random

import pytest

from arpo_algo.core.branching import (
    BRANCH_POLICIES,
    AEPOPaperRule,
    AEPOReferenceRule,
    APPOScore,
    Candidate,
    Never,
    PaperRule,
    RandomRate,
    ReferenceRule,
    appo_score,
    mean_logprob_gain,
    penalty_factor,
)
from arpo_algo.core.tree import MODE_POLICIES, TreeConfig, branch_policy, branch_rng, num_branches
from arpo_base.errors import ConfigError


class FixedRate:
    """A random policy at a fixed rate: each possible clone with probability ``rate``, one seeded draw each."""

    lookahead, fresh_baseline, needs_logprobs = False, False, True
    rate = 0.25

    def __init__(self, cfg):
        self.cfg, self.seen = cfg, []

    def branches(self, c: Candidate) -> int:
        self.seen.append(c)
        return sum(c.rng.random() < self.rate for _ in range(c.cap))


def test_each_mode_and_rule_resolves_to_its_policy():
    expected = {
        ("arpo", "paper"): PaperRule,
        ("arpo", "reference"): ReferenceRule,
        ("aepo", "paper"): AEPOPaperRule,
        ("aepo", "reference"): AEPOReferenceRule,
    }
    for (mode, rule), cls in expected.items():
        cfg = TreeConfig(mode=mode, decision_rule=rule)
        assert type(branch_policy(cfg)) is cls and cfg.policy_name == MODE_POLICIES[mode][rule]
    assert type(branch_policy(TreeConfig.grpo(4))) is Never
    assert set(BRANCH_POLICIES) >= {"never", "paper", "reference", "aepo_paper", "aepo_reference"}
    # what the sampler reads from the policy: when it asks, and whose baseline a clone keeps
    assert PaperRule.lookahead and not ReferenceRule.lookahead and not Never.lookahead
    assert ReferenceRule.fresh_baseline and not PaperRule.fresh_baseline


def test_the_policies_compute_the_rules_of_the_docs():
    aepo = TreeConfig.aepo(16, 4, decision_rule="paper", aepo_penalty=0.05)
    for dh in (-0.5, 0.0, 0.1, 0.5, 2.0):
        for l_ in range(0, 25, 4):
            assert AEPOPaperRule(aepo).decide(dh, l_) == ((0.5 + 0.2 * dh) * penalty_factor(0.05, l_) > 0.5)
            assert PaperRule(aepo).decide(dh, l_) == (0.5 + 0.2 * dh > 0.5)  # ARPO's rule has no penalty
            for u in (0.0, 0.3, 0.7, 0.99):
                assert ReferenceRule(aepo).clone(dh, l_, u) == (min(1.0, max(0.0, u - 0.2 * dh)) <= 0.5)
                pf = penalty_factor(0.05, l_)
                assert AEPOReferenceRule(aepo).clone(dh, l_, u) == (min(1.0, max(0.0, (u + 0.2 * dh) * pf)) >= 0.5)


def test_a_policy_sees_the_candidate_and_is_held_to_its_frame():
    cfg = TreeConfig(branch_factor=3, max_depth=2)
    policy = FixedRate(cfg)
    rng = random.Random(0)
    n = num_branches(
        cfg, 0.4, 1, 2, free=2, rng=rng, policy=policy, h_init=1.0, h_now=1.4, h_before=0.9, logprobs=[-0.5]
    )
    (c,) = policy.seen
    assert (c.delta_h, c.depth, c.consecutive, c.free, c.cap) == (0.4, 1, 2, 2, 2)  # cap = min(Z, free)
    assert (c.h_init, c.h_now, c.h_before, list(c.logprobs), c.rng) == (1.0, 1.4, 0.9, [-0.5], rng)
    assert 0 <= n <= 2
    assert num_branches(cfg, 0.4, 2, 0, free=2, rng=rng, policy=policy) == 0  # past max_depth: not asked
    assert num_branches(cfg, 0.4, 0, 0, free=0, rng=rng, policy=policy) == 0  # no budget: not asked
    assert len(policy.seen) == 1

    class Greedy(FixedRate):
        def branches(self, c):
            return 99

    assert num_branches(cfg, 0.0, 0, 0, free=2, rng=rng, policy=Greedy(cfg)) == 2  # never more than the cap


def test_decision_rule_and_branch_policy_never_contradict():
    assert TreeConfig(branch_policy="paper").validate().policy_name == "paper"  # the same rule twice is fine
    assert TreeConfig(mode="aepo", branch_policy="aepo_paper").validate().policy_name == "aepo_paper"
    cases = [
        (dict(branch_policy="reference"), "set decision_rule='reference'"),
        (dict(mode="aepo", branch_policy="paper"), "decision_rule selects the algorithm's own rule"),
        (dict(mode="aepo", decision_rule="reference", branch_policy="aepo_paper"), "set decision_rule='paper'"),
    ]
    for kw, hint in cases:
        with pytest.raises(ConfigError, match="contradicts decision_rule") as err:
            TreeConfig(**kw).validate()
        assert hint in err.value.hint, (kw, err.value.hint)
    with pytest.raises(ConfigError, match="not a registered branch policy"):
        TreeConfig(branch_policy="papr").validate()


def _random_stream(rate: float, seed: int, caps: list[int]) -> list[int]:
    """The random policy's answers at candidates with the given caps, on one prompt's seeded branch stream."""
    cfg = TreeConfig(branch_factor=3, branch_policy="random", random_rate=rate).validate()
    rng, policy = branch_rng(seed, 0, 0), branch_policy(cfg)
    return [num_branches(cfg, 0.0, 0, 0, free=cap, rng=rng, policy=policy) for cap in caps]


def test_the_random_policy_branches_each_opportunity_at_its_rate():
    assert isinstance(branch_policy(TreeConfig(branch_policy="random")), RandomRate)
    assert not RandomRate.lookahead and not RandomRate.fresh_baseline  # asked where the reference rule is asked
    caps = [1, 2, 3] * 4000  # free budget 1, 2, 3 with Z = 3: the cap is the free budget
    opportunities = sum(caps)
    for rate in (0.05, 0.3, 0.8):
        made = _random_stream(rate, 7, caps)
        assert all(0 <= n <= cap for n, cap in zip(made, caps))
        # the branches are Binomial(opportunities, rate): the realised rate is within 4 standard deviations
        sd = (rate * (1 - rate) / opportunities) ** 0.5
        assert abs(sum(made) / opportunities - rate) < 4 * sd, rate
    assert sum(_random_stream(0.0, 7, caps)) == 0 and _random_stream(1.0, 7, caps) == caps


def test_the_random_policy_gives_the_same_tree_for_the_same_seed():
    caps = [3, 1, 2] * 200
    assert _random_stream(0.4, 11, caps) == _random_stream(0.4, 11, caps)
    assert _random_stream(0.4, 11, caps) != _random_stream(0.4, 12, caps)
    # one draw per possible clone, made iff the draw is below the rate: the decisions replay from the stream alone
    replay = branch_rng(11, 0, 0)
    assert _random_stream(0.4, 11, caps) == [sum(replay.random() < 0.4 for _ in range(c)) for c in caps]


def test_the_random_rate_is_a_probability_and_a_setting():
    from arpo_algo.algorithms.settings import Settings
    from arpo_algo.run.sweep import BRANCHING_KNOBS

    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match=r"random_rate must be in \[0, 1\]") as err:
            TreeConfig(branch_policy="random", random_rate=bad).validate()
        assert "branches_per_opportunity" in err.value.hint
    with pytest.raises(ConfigError, match="random_rate"):
        TreeConfig.from_dict({"branch_policy": "random", "random_rate": "high"})
    settings = Settings().update({"tree.branch_policy": "random", "tree.random_rate": 0.25}, "test")
    assert settings.tree.random_rate == 0.25 and settings.tree.policy_name == "random"
    assert "random_rate" in BRANCHING_KNOBS  # a sweep knob like tau, dropped for GRPO with the other branching knobs


def test_the_appo_score_is_uncertainty_times_likelihood_gain():
    # U = 1 - exp(-H): ln 2 nats -> 1/2, ln 4 -> 3/4; L = sigmoid(w * G): G = 0 -> 1/2, w * G = ln 3 -> 3/4
    assert appo_score(0.0, 5.0, 1.0) == 0.0  # a certain look-ahead never scores, whatever the gain
    assert appo_score(math.log(2), 0.0, 1.0) == pytest.approx(0.25)
    assert appo_score(math.log(4), math.log(3), 1.0) == pytest.approx(0.5625)
    assert appo_score(math.log(4), -math.log(3), 1.0) == pytest.approx(0.1875)
    assert appo_score(math.log(4), 0.5 * math.log(3), 2.0) == pytest.approx(0.5625)  # w scales the gain
    assert appo_score(math.log(4), 100.0, 0.0) == pytest.approx(0.375)  # w = 0: the entropy alone
    # G: the look-ahead's first k log-probs over the last k sampled before the result (k = 2 here)
    assert mean_logprob_gain([-9.0, -1.0, -3.0], [-0.5, -1.5, -9.0], 2) == pytest.approx(-1.0 - (-2.0))
    assert mean_logprob_gain([], [-0.5], 2) == 0.0 and mean_logprob_gain([-1.0], [], 2) == 0.0


def _appo_candidate(h_now: float, before: list[float], after: list[float], cap: int = 2) -> Candidate:
    return Candidate(0.0, 0, 0, cap, cap, None, 0.5, h_now, None, before, after)


def test_the_appo_policy_branches_the_cap_iff_its_score_beats_the_threshold():
    cfg = TreeConfig(branch_factor=2, branch_policy="appo", appo_threshold=0.3, entropy_tokens=2).validate()
    policy = branch_policy(cfg)
    assert isinstance(policy, APPOScore) and APPOScore.lookahead and APPOScore.needs_logprobs
    assert not APPOScore.fresh_baseline
    ln4 = math.log(4)
    # G = mean(-0.1, -0.1) - mean(-1.2, -1.2) = 1.1 > ln 3 (1.0986): score above 3/4 * 3/4 = 0.5625 -> the cap
    high = _appo_candidate(ln4, [-7.0, -1.2, -1.2], [-0.1, -0.1])
    # the same entropy, the gain reversed: 3/4 * sigmoid(-1.1) < 0.3 -> none
    low = _appo_candidate(ln4, [-0.1, -0.1], [-1.2, -1.2, -7.0])
    assert policy.gain(high) == pytest.approx(1.1) and policy.gain(low) == pytest.approx(-1.1)
    assert policy.score(high) > 0.5625 > 0.3 > policy.score(low)
    assert policy.branches(high) == 2 and policy.branches(low) == 0
    # the threshold is strict: at ln 2 and no gain the score is exactly 1/4
    at = _appo_candidate(math.log(2), [-1.0], [-1.0])
    assert branch_policy(TreeConfig(branch_policy="appo", appo_threshold=0.25)).branches(at) == 0
    assert branch_policy(TreeConfig(branch_policy="appo", appo_threshold=0.2499)).branches(at) == 2
    # w = 0: the gain is ignored, the entropy alone decides (ln 4 -> 3/8 > 0.3)
    flat = TreeConfig(branch_factor=2, branch_policy="appo", appo_threshold=0.3, appo_gain_weight=0.0)
    assert branch_policy(flat).branches(low) == 2
    # deterministic and drawless: the frame's branch RNG is left untouched
    rng = branch_rng(0, 0, 0)
    state = rng.getstate()
    assert num_branches(cfg, 0.0, 0, 0, 2, rng, h_now=ln4, logprobs=[-1.2], lookahead_logprobs=[-0.1]) == 2
    assert rng.getstate() == state
    with pytest.raises(ValueError, match="look-ahead entropy"):
        policy.branches(Candidate(0.0, 0, 0, 1, 1))  # no H_now: refused, not guessed


def test_the_appo_knobs_are_checked_settings_and_sweep_knobs():
    from arpo_algo.algorithms.settings import Settings
    from arpo_algo.run.sweep import BRANCHING_KNOBS

    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match=r"appo_threshold must be in \[0, 1\]"):
            TreeConfig(branch_policy="appo", appo_threshold=bad).validate()
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="appo_gain_weight must be a finite number >= 0"):
            TreeConfig(branch_policy="appo", appo_gain_weight=bad).validate()
    with pytest.raises(ConfigError, match="appo_threshold"):
        TreeConfig.from_dict({"branch_policy": "appo", "appo_threshold": "high"})
    settings = Settings().update({"tree.branch_policy": "appo", "tree.appo_threshold": 0.4}, "test")
    assert settings.tree.appo_threshold == 0.4 and settings.tree.policy_name == "appo"
    assert {"appo_threshold", "appo_gain_weight", "random_lookahead"} <= set(BRANCHING_KNOBS)


def test_random_lookahead_moves_the_random_decision_after_the_look_ahead():
    assert not branch_policy(TreeConfig(branch_policy="random")).lookahead
    late = branch_policy(TreeConfig(branch_policy="random", random_lookahead=True))
    assert late.lookahead and not RandomRate.lookahead  # per config, not per class
    # the draws are the same either way: one per possible clone, made iff below the rate
    caps = [3, 1, 2] * 50
    cfg = TreeConfig(branch_factor=3, branch_policy="random", random_rate=0.4, random_lookahead=True).validate()
    rng = branch_rng(11, 0, 0)
    assert branch_policy(cfg).lookahead
    assert [num_branches(cfg, 0.0, 0, 0, c, rng) for c in caps] == _random_stream(0.4, 11, caps)
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="random_lookahead must be true or false"):
            TreeConfig(branch_policy="random", random_lookahead=bad).validate()
    with pytest.raises(ConfigError, match="random_lookahead"):
        TreeConfig.from_dict({"branch_policy": "random", "random_lookahead": "yes"})


def test_a_policys_own_knob_set_for_another_policy_is_refused_naming_its_reader():
    """A setting that is accepted acts: random's and appo's knobs are refused while another policy is in effect."""
    for kw, reader in (
        ({"random_rate": 0.3}, "random"),
        ({"random_lookahead": True}, "random"),
        ({"appo_threshold": 0.3}, "appo"),
        ({"branch_policy": "random", "appo_gain_weight": 0.0}, "appo"),
        ({"branch_policy": "appo", "random_rate": 0.1}, "random"),
    ):
        with pytest.raises(ConfigError, match=rf"read only by branch_policy '{reader}'") as err:
            TreeConfig(**kw).validate()
        assert f"branch_policy = '{reader}'" in err.value.hint
    assert TreeConfig(random_rate=0.5).validate().unread_knobs() == []  # the default is not a setting made
    shared = TreeConfig(branch_policy="appo", random_lookahead=True, appo_threshold=0.3).without_unread_knobs()
    assert shared.validate().random_lookahead is False and shared.appo_threshold == 0.3
