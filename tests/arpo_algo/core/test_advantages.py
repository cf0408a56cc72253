"""Advantage estimators: GRPO, hard attribution on a hand-built tree, AEPO entropy-aware advantage."""

from __future__ import annotations

import pytest
import torch

from arpo_algo.core.advantages import (
    build_token_trie,
    entropy_aware_advantages,
    grpo_advantages,
    hard_attribution,
    tree_token_owners,
)


def test_grpo_matches_torch_std():
    rewards = [1.0, 0.0, 0.5, 0.0]
    r = torch.tensor(rewards, dtype=torch.float64)
    want = ((r - r.mean()) / (r.std() + 1e-6)).tolist()
    assert grpo_advantages(rewards) == pytest.approx(want)
    assert grpo_advantages(rewards, norm_by_std=False) == pytest.approx((r - r.mean()).tolist())
    assert grpo_advantages([0.7]) == pytest.approx([0.7])  # size 1: mean 0, std 1 (reference)
    assert grpo_advantages([1.0, 1.0]) == [0.0, 0.0]  # equal rewards: no signal, no division by zero
    assert grpo_advantages([]) == []


def test_token_trie_merges_prefixes():
    trie = build_token_trie([[1, 2, 3], [1, 2, 4, 5], [1, 2, 3], [7]])
    assert trie.num_nodes == 6
    assert trie.paths[0] == trie.paths[2] and trie.first_new[2] == 3  # exact duplicate adds nothing
    assert trie.paths[1][:2] == trie.paths[0][:2] and trie.first_new[1] == 2
    assert trie.depth == [0, 1, 2, 2, 3, 0] and trie.parent == [-1, 0, 1, 1, 3, -1]


def test_hard_attribution_on_hand_built_tree():
    # prompt [9]; A = 5 6 7, B = 5 6 8 (token 6 untrained in B: a tool result), C = 5 4.
    token_adv, mult = hard_attribution(
        [9], [[5, 6, 7], [5, 6, 8], [5, 4]], [[1, 1, 1], [1, 0, 1], [1, 1]], [1.0, -1.0, 4.0]
    )
    shared5 = (1.0 - 1.0 + 4.0) / 3
    assert token_adv[0] == pytest.approx([shared5, 1.0, 1.0]) and mult[0] == [3, 1, 1]
    assert token_adv[1] == pytest.approx([shared5, 0.0, -1.0]) and mult[1] == [3, 0, 1]
    assert token_adv[2] == pytest.approx([shared5, 4.0]) and mult[2] == [3, 1]


def test_hard_attribution_respects_the_prompt():
    # Identical responses under different prompts are different tokens (different contexts), but within one group
    # the prompt is shared, so an identical response is fully shared.
    token_adv, mult = hard_attribution([1, 2], [[3, 4], [3, 4]], [[1, 1], [1, 1]], [2.0, 0.0])
    assert token_adv == [[1.0, 1.0], [1.0, 1.0]] and mult == [[2, 2], [2, 2]]


def test_entropy_aware_advantage_per_group_and_clip():
    ent = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 0.0])
    group = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0, 2.0, 0.5])
    new, z = entropy_aware_advantages(adv, ent, torch.ones(6), group, 3, coef=0.2)
    # group 0: mean 2, unbiased std 1 -> z = -1, 0, 1; group 1: std 0 -> 1 -> z = 0; group 2: one token -> z = 0.
    assert z.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    assert new.tolist() == pytest.approx([0.8, 1.0, -1.2, 2.0, 2.0, 0.5])
    # A very low-entropy token: 1 + 0.2 z < 0 flips the sign unless clipped at a minimum multiplier.
    ent2 = torch.tensor([0.0] + [10.0] * 99)
    adv2 = torch.ones(100)
    g2 = torch.zeros(100, dtype=torch.long)
    flipped, z2 = entropy_aware_advantages(adv2, ent2, torch.ones(100), g2, 1)
    assert float(z2[0]) < -5 and float(flipped[0]) < 0
    kept, _ = entropy_aware_advantages(adv2, ent2, torch.ones(100), g2, 1, min_multiplier=0.0)
    assert float(kept[0]) == 0.0 and float(kept[1]) > 1.0


def test_entropy_weights_make_copies_equal_to_counts():
    # Two copies with weight 1/2 each are the same as one token with weight 1 (hard attribution, both layouts).
    ent_a, w_a = torch.tensor([1.0, 1.0, 4.0, 7.0]), torch.tensor([0.5, 0.5, 1.0, 1.0])
    ent_b, w_b = torch.tensor([1.0, 4.0, 7.0]), torch.ones(3)
    _, za = entropy_aware_advantages(torch.ones(4), ent_a, w_a, torch.zeros(4, dtype=torch.long), 1)
    _, zb = entropy_aware_advantages(torch.ones(3), ent_b, w_b, torch.zeros(3, dtype=torch.long), 1)
    assert za[1:].tolist() == pytest.approx(zb.tolist())


def test_estimators_are_registered_by_name():
    from arpo_algo.core.advantages import ADVANTAGE_SHAPERS, ADVANTAGES
    from arpo_base.errors import ConfigError

    prompt, responses, masks = [1, 2], [[3, 4, 5], [3, 4, 6]], [[1, 1, 1], [1, 1, 1]]
    soft = ADVANTAGES.lookup("grpo")(prompt, responses, masks, [1.0, 0.0])
    a = grpo_advantages([1.0, 0.0])
    assert soft.advantages == [[a[0]] * 3, [a[1]] * 3] and soft.weights == [[1.0] * 3, [1.0] * 3]
    hard = ADVANTAGES.lookup("hard")(prompt, responses, masks, [1.0, 0.0])
    tok, mult = hard_attribution(prompt, responses, masks, a)
    assert hard.advantages == tok and hard.weights == [[1 / d for d in m] for m in mult]
    assert hard.weights[0][:2] == [0.5, 0.5] and ADVANTAGES.meta["hard"] == {"merge_shared": True}
    assert ADVANTAGE_SHAPERS.lookup("entropy_aware") is entropy_aware_advantages
    with pytest.raises(ConfigError, match="learner.advantage: unknown advantage estimator 'hrad'") as err:
        ADVANTAGES.lookup("hrad")
    assert err.value.hint == "did you mean 'hard'? registered: grpo, hard"


def test_hard_attribution_scopes_tree_and_tokens():
    """Trajectory 1 branched from 0 after 2 tokens; 2 is an independent sample that starts like 0 by chance."""
    responses = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 4]]
    masks = [[1] * 4, [1] * 3, [1] * 4]
    adv = [1.0, -1.0, 3.0]
    owners = tree_token_owners([None, 0, None], [None, 2, None], [4, 3, 4])
    assert owners == [[0, 0, 0, 0], [0, 0, 1], [2, 2, 2, 2]]
    tree_adv, tree_mult = hard_attribution([1], responses, masks, adv, owners)
    # tree scope: only the branch's inherited prefix is shared (mean of 0 and 1); sample 2 keeps its own advantage
    assert tree_adv == [[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, -1.0], [3.0] * 4]
    assert tree_mult == [[2, 2, 1, 1], [2, 2, 1], [1] * 4]
    tok_adv, tok_mult = hard_attribution([1], responses, masks, adv)
    # tokens scope: the identical prefixes of independent samples merge too
    assert tok_adv[2] == [1.0, 1.0, 2.0, 3.0] and tok_mult[2] == [3, 3, 2, 1]
