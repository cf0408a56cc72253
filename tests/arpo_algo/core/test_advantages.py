"""Advantage estimators: GRPO, hard attribution on a hand-built tree, AEPO entropy-aware advantage."""

from __future__ import annotations

import pytest
import torch

from arpo_algo.core.advantages import (
    ROOT,
    build_token_trie,
    entropy_aware_advantages,
    grpo_advantages,
    hard_attribution,
    share_keys,
    tree_token_owners,
    turn_advantages,
    turn_tree,
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
    assert hard.weights[0][:2] == [0.5, 0.5] and ADVANTAGES.meta["hard"]["merge_shared"]
    assert ADVANTAGE_SHAPERS.lookup("entropy_aware") is entropy_aware_advantages
    with pytest.raises(ConfigError, match="learner.advantage: unknown advantage estimator 'hrad'") as err:
        ADVANTAGES.lookup("hrad")
    assert err.value.hint == "did you mean 'hard'? registered: grpo, hard, turn"
    assert ADVANTAGES.meta["turn"] == {"needs_tree": True} and ADVANTAGES.meta["hard"]["needs_tree"]


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


# A hand-built tree (prompt [9]); token 3 is a tool result. Trajectory 1 branched from 0 right after it (position 3),
# trajectory 2 one token into the next turn (position 4, a look-ahead branch), trajectory 3 is an independent sample.
HAND = dict(
    responses=[[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 4, 7], [8, 8]],
    masks=[[1, 1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 0, 1, 1], [1, 1]],
    parents=[None, 0, 0, None],
    branch_points=[None, 3, 4, None],
    rewards=[1.0, 0.0, 1.0, 0.0],
)


def _hand_owners():
    return tree_token_owners(HAND["parents"], HAND["branch_points"], [len(r) for r in HAND["responses"]])


def test_turn_credit_on_a_hand_built_tree():
    # Values: the node after [1 2 3 4] has children 0 and 2 (both 1.0) -> 1.0; the node after the tool result has
    # that node and trajectory 1 (0.0) -> 0.5; the root has that node and trajectory 3 (0.0) -> 0.25. The plain leaf
    # mean would give 2/3 and 0.5 instead.
    tok = turn_advantages(
        [9], HAND["responses"], HAND["masks"], HAND["rewards"], norm_by_std=False, owners=_hand_owners()
    )
    assert tok.advantages == [
        [0.25, 0.25, 0.0, 0.5, 0.0],
        [0.25, 0.25, 0.0, -0.5],
        [0.25, 0.25, 0.0, 0.5, 0.0],
        [-0.25, -0.25],
    ]
    assert tok.weights == [[1.0] * len(r) for r in HAND["responses"]]  # one copy per trajectory, as soft attribution
    tree = turn_tree(share_keys([9], HAND["responses"], _hand_owners()), HAND["masks"], HAND["rewards"])
    assert tree.values[ROOT] == 0.25 and [b for b, _ in tree.paths[0]] == [0, 3, 4, 5]
    # Divided by the group's reward std + eps (GRPO's scale): the path sums are then the GRPO advantages minus the
    # root's value over that scale.
    std = (sum((r - 0.5) ** 2 for r in HAND["rewards"]) / 3) ** 0.5 + 1e-6
    normed = turn_advantages([9], HAND["responses"], HAND["masks"], HAND["rewards"], owners=_hand_owners())
    assert normed.advantages[1] == pytest.approx([0.25 / std, 0.25 / std, 0.0, -0.5 / std])
    # Sharing comes from the tree, not from equal tokens: two independent samples that start alike are two children
    # of the root under scope "tree", one shared first token under "tokens".
    alike = dict(responses=[[5, 6], [5, 7]], trained_masks=[[1, 1], [1, 1]], rewards=[1.0, 0.0], norm_by_std=False)
    assert turn_advantages([9], **alike, owners=[[0, 0], [1, 1]]).advantages == [[0.5, 0.5], [-0.5, -0.5]]
    assert turn_advantages([9], **alike).advantages == [[0.0, 0.5], [0.0, -0.5]]
    # Scope "tokens": here the shared prefixes are also identical tokens, so the same values.
    assert turn_advantages([9], HAND["responses"], HAND["masks"], HAND["rewards"], norm_by_std=False).advantages == (
        tok.advantages
    )


def test_turn_credit_without_branches_is_grpo_on_the_first_turn():
    responses, masks = [[1, 2, 3, 4], [5, 6], [7, 8, 9]], [[1, 0, 1, 1], [1, 1], [1, 0, 1]]
    rewards = [1.0, 0.0, 0.5]
    owners = tree_token_owners([None] * 3, [None] * 3, [4, 2, 3])
    tok = turn_advantages([9], responses, masks, rewards, owners=owners)
    a = grpo_advantages(rewards)
    # One sample per node after the root: each later turn's baseline is its own outcome, so only the first turn
    # carries credit, and it is GRPO's.
    assert tok.advantages == [[a[0], 0.0, 0.0, 0.0], [a[1], a[1]], [a[2], 0.0, 0.0]]
    assert turn_advantages([9], responses, masks, [1.0] * 3, owners=owners).advantages == [
        [0.0] * 4,
        [0.0] * 2,
        [0.0] * 3,
    ]
    one = turn_advantages([9], [[1, 2]], [[1, 1]], [0.7], owners=[[0, 0]])
    assert one.advantages == [[grpo_advantages([0.7])[0]] * 2]  # a group of one: baseline 0 and std 1, as GRPO


def _random_tree(rng):
    """Trajectories of turns (1-3 model tokens, then 1-2 tool tokens or the end) with branches at model tokens."""

    def tail(tokens, mask):
        tokens, mask = list(tokens), list(mask)
        while True:
            n = rng.randint(1, 3)
            tokens += [rng.randint(1, 50) for _ in range(n)]
            mask += [1] * n
            if rng.random() < 0.4:
                return tokens, mask
            n = rng.randint(1, 2)
            tokens += [0] * n
            mask += [0] * n

    trajs = [(*tail([], []), None, None) for _ in range(rng.randint(1, 3))]
    for _ in range(rng.randint(0, 6)):
        j = rng.randrange(len(trajs))
        tokens, mask = trajs[j][0], trajs[j][1]
        cut = [t for t in range(1, len(tokens)) if mask[t]]
        if cut:
            p = rng.choice(cut)
            trajs.append((*tail(tokens[:p], mask[:p]), j, p))
    rewards = [float(rng.randint(0, 3)) for _ in trajs]
    return [t[0] for t in trajs], [t[1] for t in trajs], [t[2] for t in trajs], [t[3] for t in trajs], rewards


def test_turn_credit_telescopes_and_shares_on_random_trees():
    import random

    rng = random.Random(0)
    for _ in range(200):
        responses, masks, parents, bps, rewards = _random_tree(rng)
        owners = tree_token_owners(parents, bps, [len(r) for r in responses])
        keys = share_keys([], responses, owners)
        tok = turn_advantages([], responses, masks, rewards, norm_by_std=False, owners=owners)
        tree = turn_tree(keys, masks, rewards)
        seen = {}
        for j, path in enumerate(tree.paths):
            starts = [b for b, _ in path]
            # every turn start and every branch point on the path is a node
            for b in range(1, len(masks[j])):
                branched = any(k != j and bps[k] == b and owners[k][b - 1] == owners[j][b - 1] for k in range(len(bps)))
                branched |= bps[j] == b  # where it left its parent
                if (masks[j][b] and not masks[j][b - 1]) or branched:
                    assert b in starts, (j, b, starts)
            # the advantages of a path's turns sum to its reward minus the root's value
            total = sum(tok.advantages[j][b] for b in starts[:-1])
            assert total == pytest.approx(rewards[j] - tree.values[ROOT])
            for t, (k, m) in enumerate(zip(keys[j], masks[j])):
                if not m:
                    assert tok.advantages[j][t] == 0.0  # tool results carry no credit
                assert seen.setdefault(k, tok.advantages[j][t]) == tok.advantages[j][t]  # one value per shared token
