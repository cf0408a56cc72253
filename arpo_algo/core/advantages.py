"""Advantage estimators: GRPO (soft attribution), hard attribution over a token trie, and AEPO's entropy-aware term.

* **Soft attribution** (the paper's default and what the reference trains, docs/concepts/arpo.md#soft-attribution):
  plain GRPO over every trajectory of the group. A token on a prefix shared by d trajectories is trained once per
  trajectory, each copy with its own trajectory's advantage (so its weight grows with d;
  docs/concepts/arpo.md#soft-attribution).
* **Hard attribution** (docs/concepts/arpo.md#hard-attribution, an option): a token shared by d trained trajectories is
  counted **once** with the mean of their advantages. Sharing is found from the token ids (prompt + response) with a
  token trie.
* **Hard attribution scope**: ``"tree"`` (default) shares a token only between trajectories that
  inherited it by branching (the paper's "segment shared by d trajectories": one sample, counted once);
  ``"tokens"`` shares every identical prompt+response prefix of the group, so two *independent* samples that happen
  to start alike are also merged (counted once with their mean advantage). That down-weights popular prefixes
  among independent draws, which the policy-gradient estimator does not do, so it is kept only by name.
* **Entropy-aware advantage** (AEPO, docs/concepts/aepo.md#entropy-aware-advantage): ``A·(1 + coef·z)`` with ``z`` the
  z-score of the current policy's token entropy. It is *working* here (the reference silently skips it,
  docs/concepts/aepo.md#entropy-aware-advantage). Normalisation scope: **per group** (mean/std over the group's trained
  tokens, counted with the same multiplicity as in the loss), not the reference's micro-batch, so the value does not
  depend on how the batch happens to be split. An optional minimum multiplier
  (``entropy_advantage_clip``, e.g. 0.0) stops the sign of ``A`` from flipping when ``z < -1/coef``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from arpo_algo.core.registry import Registry

GRPO_EPS = 1e-6
#: Rewards of one group whose spread (max - min) is at most this, relative to their scale (at least 1), are equal:
#: their GRPO advantages would be rounding noise (e.g. 1.1 for every trajectory gives |A| ~ 1e-10).
REWARD_SPREAD_TOL = 1e-6


def rewards_have_spread(rewards: Sequence[float], tol: float = REWARD_SPREAD_TOL) -> bool:
    """Whether a group's rewards carry a learning signal: they differ by more than ``tol`` (relative, scale >= 1).

    The one "no signal" rule: the learner, dynamic sampling and the diagnostics all ask this. A group of one
    trajectory has signal when its reward (its own advantage, see :func:`grpo_advantages`) is not zero. A
    non-finite reward is not "no signal": it must reach the loss, whose non-finite guard counts and stops it.
    """
    rs = [float(r) for r in rewards]
    if not rs:
        return False
    if not all(math.isfinite(r) for r in rs):
        return True
    scale = max(1.0, max(abs(r) for r in rs))
    if len(rs) == 1:
        return abs(rs[0]) > tol * scale
    return max(rs) - min(rs) > tol * scale


#: Advantage estimators by name (``learner.advantage``). Each is
#: ``fn(prompt_ids, responses, trained_masks, rewards, *, norm_by_std, **extra) -> TokenAdvantages``: an advantage
#: and a count weight for every response token of every trajectory of one group. Metadata ``merge_shared=True`` tells
#: the learner that tokens shared by several trajectories are counted once (the deduplicated batch then merges them);
#: ``needs_tree=True`` that the estimator takes ``owners`` (:func:`tree_token_owners`, which tokens were shared by
#: branching; ``training.hard_scope = "tree"``) or None (shared = identical prefix, ``"tokens"``), see
#: :func:`arpo_algo.train.update_stats.group_token_advantages`, the one place that builds the call.
ADVANTAGES = Registry("advantage estimator", "learner.advantage")
register_advantage = ADVANTAGES.register
#: Per-token advantage shaping applied at loss time, when the current policy's entropies are known, by name. Each is
#: ``fn(adv, entropy, weight, group, num_groups, *, coef, min_multiplier) -> (new_adv, z)`` on flat tensors.
#: ``"entropy_aware"`` (AEPO, docs/concepts/aepo.md#entropy-aware-advantage) is switched on by
#: ``learner.entropy_advantage``; it composes with any estimator.
ADVANTAGE_SHAPERS = Registry("advantage shaping", "learner.entropy_advantage")
register_advantage_shaper = ADVANTAGE_SHAPERS.register


@dataclass
class TokenAdvantages:
    """One group's per-token advantages.

    Attributes:
        advantages: Per trajectory, one advantage per response token.
        weights: Per trajectory, one count weight per response token (1.0 per trajectory copy for soft attribution;
            ``1/d`` for a token shared by d trajectories under hard attribution; 0.0 for untrained tokens there).
        values: For an estimator that values the tree's nodes ("turn"), per trajectory the nodes of its path, root
            first, as ``(response position, value in reward units)``; None for the others. The tree recorder keeps
            them for the viewer.
    """

    advantages: list[list[float]]
    weights: list[list[float]]
    values: list[list[tuple[int, float]]] | None = None


def group_mean_std(rewards: Sequence[float]) -> tuple[float, float]:
    """GRPO's ``(mean, std)`` of one group's rewards: the unbiased standard deviation (as ``torch.std``); a group of
    one uses mean 0 and std 1, as the reference does."""
    n = len(rewards)
    if n == 1:
        return 0.0, 1.0
    mean = sum(rewards) / n
    return mean, math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))


def grpo_advantages(rewards: list[float], *, norm_by_std: bool = True, eps: float = GRPO_EPS) -> list[float]:
    """GRPO outcome advantages ``(r - mean) / (std + eps)`` of one group.

    ``std`` is the unbiased standard deviation (as ``torch.std``). A group of size 1 uses mean 0 and std 1, as the
    reference does, so its advantage is the raw reward.

    Args:
        rewards: The scalar rewards of the group's trajectories.
        norm_by_std: Divide by ``std + eps`` (reference ``norm_adv_by_std_in_grpo=True``); False gives ``r - mean``.
        eps: Added to the std.

    Returns:
        One advantage per reward, in the same order.
    """
    n = len(rewards)
    if n == 0:
        return []
    if not rewards_have_spread(rewards):  # equal rewards: exactly zero, never rounding noise the optimizer follows
        return [0.0] * n
    mean, std = group_mean_std(rewards)
    if not norm_by_std:
        return [r - mean for r in rewards]
    return [(r - mean) / (std + eps) for r in rewards]


@dataclass
class TokenTrie:
    """Token sequences merged on identical prefixes.

    Nodes are numbered in insertion order (sequence by sequence), so a parent always precedes its children and the
    nodes a sequence adds form one contiguous id range at the end of its path (the packed layout relies on that).

    Attributes:
        parent: Parent node per node (-1 for a first token).
        token: Token id per node.
        depth: Position of the node in its sequences (0 for a first token).
        paths: Per sequence, the node id of each of its positions.
        first_new: Per sequence, the index in its path of the first node it created (== len(path) if none).
    """

    parent: list[int] = field(default_factory=list)
    token: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    paths: list[list[int]] = field(default_factory=list)
    first_new: list[int] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return len(self.token)


def build_token_trie(sequences: list[list[int]]) -> TokenTrie:
    """Merge token sequences into a :class:`TokenTrie` (identical prefixes become one path)."""
    trie = TokenTrie()
    children: list[dict[int, int]] = []
    roots: dict[int, int] = {}
    for seq in sequences:
        cur, path, first_new = -1, [], None
        for pos, tok in enumerate(seq):
            table = roots if cur < 0 else children[cur]
            nid = table.get(tok)
            if nid is None:
                nid = trie.num_nodes
                table[tok] = nid
                trie.parent.append(cur)
                trie.token.append(tok)
                trie.depth.append(pos)
                children.append({})
                if first_new is None:
                    first_new = pos
            path.append(nid)
            cur = nid
        trie.paths.append(path)
        trie.first_new.append(len(seq) if first_new is None else first_new)
    return trie


def tree_token_owners(
    parents: list[int | None], branch_points: list[int | None], lengths: list[int]
) -> list[list[int]]:
    """Per trajectory and response position, the trajectory that sampled that token: a branch's tokens before its
    branch point belong to its parent's (recursively), every other token to the trajectory itself."""
    owners: list[list[int]] = []
    for j, n in enumerate(lengths):
        row = []
        for t in range(n):
            k = j
            while parents[k] is not None and t < (branch_points[k] or 0):
                k = parents[k]  # type: ignore[assignment]
            row.append(k)
        owners.append(row)
    return owners


def share_keys(
    prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], owners: list[list[int]] | None = None
) -> list[list[object]]:
    """Per trajectory and response position, a key that two trajectories have in common exactly when they share that
    token, and with it the whole prefix before it: ``(owner, position)`` with ``owners`` (:func:`tree_token_owners`,
    scope "tree"), else the token's node in the group's :class:`TokenTrie` (scope "tokens")."""
    if owners is None:
        trie = build_token_trie([list(prompt_ids) + list(r) for r in responses])
        p = len(prompt_ids)
        return [[trie.paths[j][p + t] for t in range(len(r))] for j, r in enumerate(responses)]
    return [[(owners[j][t], t) for t in range(len(r))] for j, r in enumerate(responses)]


def hard_attribution(
    prompt_ids: list[int],
    responses: list[list[int]],
    trained_masks: list[list[int]],
    advantages: list[float],
    owners: list[list[int]] | None = None,
) -> tuple[list[list[float]], list[list[int]]]:
    """Hard advantage attribution over the token trie of one group.

    A trained token that d trajectories share (same prompt + response prefix, trained in each of them) gets the mean
    of those d advantages, and must be counted once in the loss: the caller either trains one copy (deduplicated
    path) or every copy with weight ``1/d`` (duplicated path). Both give the same objective.

    Args:
        prompt_ids: The group's prompt tokens.
        responses: Response tokens per trajectory.
        trained_masks: Trained mask per trajectory (same lengths as ``responses``).
        advantages: Trajectory-level advantage per trajectory (e.g. :func:`grpo_advantages`).
        owners: Scope "tree": :func:`tree_token_owners` (a token is shared when it has the same owner and position).
            None: scope "tokens" (shared = same node of the group's token trie).

    Returns:
        ``(token_adv, multiplicity)``: per trajectory and response token, the attributed advantage and d (0 for
        untrained tokens, whose advantage is 0.0).
    """
    keys = share_keys(prompt_ids, responses, owners)
    total: dict[object, float] = {}
    count: dict[object, int] = {}
    for j, mask in enumerate(trained_masks):
        for t, m in enumerate(mask):
            if m:
                node = keys[j][t]
                total[node] = total.get(node, 0.0) + advantages[j]
                count[node] = count.get(node, 0) + 1
    token_adv, mult = [], []
    for j, mask in enumerate(trained_masks):
        nodes = keys[j]
        token_adv.append([total[n] / count[n] if m else 0.0 for n, m in zip(nodes, mask)])
        mult.append([count[n] if m else 0 for n, m in zip(nodes, mask)])
    return token_adv, mult


@register_advantage("grpo")
def soft_attribution(
    prompt_ids: Sequence[int],
    responses: Sequence[Sequence[int]],
    trained_masks: Sequence[Sequence[int]],
    rewards: Sequence[float],
    *,
    norm_by_std: bool = True,
) -> TokenAdvantages:
    """GRPO over the whole tree (soft attribution): every token gets its trajectory's advantage, weight 1."""
    adv = grpo_advantages(list(rewards), norm_by_std=norm_by_std)
    return TokenAdvantages([[a] * len(r) for a, r in zip(adv, responses)], [[1.0] * len(r) for r in responses])


def episode_advantages(
    responses: Sequence[Sequence[int]],
    episode_of: Sequence[int],
    rewards: Sequence[float],
    *,
    norm_by_std: bool = True,
) -> TokenAdvantages:
    """GRPO over episodes whose sequences are several trajectories (a recorded episode's segments): the mean and
    standard deviation are over one reward per episode, however many sequences it has, and every token of a sequence
    gets its episode's advantage, weight 1."""
    order = list(dict.fromkeys(episode_of))
    per_episode = {e: rewards[episode_of.index(e)] for e in order}
    adv = dict(zip(order, grpo_advantages([per_episode[e] for e in order], norm_by_std=norm_by_std)))
    return TokenAdvantages(
        [[adv[e]] * len(r) for e, r in zip(episode_of, responses)], [[1.0] * len(r) for r in responses]
    )


@register_advantage("hard", merge_shared=True, needs_tree=True)
def hard_attribution_advantages(
    prompt_ids: Sequence[int],
    responses: Sequence[Sequence[int]],
    trained_masks: Sequence[Sequence[int]],
    rewards: Sequence[float],
    *,
    norm_by_std: bool = True,
    owners: list[list[int]] | None = None,
) -> TokenAdvantages:
    """Hard attribution (:func:`hard_attribution` over GRPO advantages): a shared token counts once. ``owners``
    (:func:`tree_token_owners`) restricts sharing to tokens shared by branching (scope "tree")."""
    adv = grpo_advantages(list(rewards), norm_by_std=norm_by_std)
    tok_adv, mult = hard_attribution(
        list(prompt_ids), [list(r) for r in responses], [list(m) for m in trained_masks], adv, owners
    )
    return TokenAdvantages(tok_adv, [[1.0 / d if d else 0.0 for d in m] for m in mult])


ROOT = "root"


@dataclass
class TurnTree:
    """The nodes of one group's tree as :func:`turn_tree` values them.

    Attributes:
        paths: Per trajectory, its nodes root first as ``(position, node)``: the node that starts at response
            position ``position`` (the root at 0), the last one at the response's end (the end of the trajectory).
        values: Per node, its value: the mean of its children's values, a trajectory's end worth its reward.
    """

    paths: list[list[tuple[int, object]]]
    values: dict[object, float]


def turn_tree(keys: list[list[object]], trained_masks: Sequence[Sequence[int]], rewards: Sequence[float]) -> TurnTree:
    """Value every node of a group's tree by Monte Carlo over its subtree.

    A node is a prefix where credit can change hands: the root, each turn start (a trained token right after an
    untrained tool-result run), each branch point (where trajectories that shared the prefix part, found from
    ``keys``, see :func:`share_keys`) and each response's end. Each child of a node is one sample of what the policy
    did from there, so a node's value is the mean of its children's values, and a trajectory's end is worth its
    reward. (The plain mean of the leaves under a node would weight a child by how often its own subtree branched,
    which depends on what that child did: biased wherever branching follows the trajectory, e.g. ARPO branching
    after tool calls.) The root's value is the mean of its children's, 0.0 for a group of one (as
    :func:`grpo_advantages`). A response that is a prefix of another (only when sharing is token equality) ends at
    a node with another child, whose value its last turn then gets instead of its own reward.
    """
    count: dict[object, int] = {}
    for row in keys:
        for k in row:
            count[k] = count.get(k, 0) + 1
    paths: list[list[tuple[int, object]]] = []
    children: dict[object, dict[object, None]] = {}
    pos: dict[object, float] = {ROOT: 0.0}
    for j, row in enumerate(keys):
        mask, n = trained_masks[j], len(row)
        path: list[tuple[int, object]] = [(0, ROOT)]
        for b in range(1, n):
            # A sharing key's count only falls along a path: a fall at b means someone sharing the prefix left there.
            if (mask[b] and not mask[b - 1]) or count[row[b]] < count[row[b - 1]]:
                path.append((b, row[b - 1]))
        if n:
            path.append((n, row[n - 1]))
        path.append((n, ("end", j)))
        for (_, a), (b, c) in zip(path, path[1:]):
            children.setdefault(a, {})[c] = None
            pos[c] = b + 0.5 if c == ("end", j) else float(b)
        paths.append(path[:-1] if n else path)
    values: dict[object, float] = {("end", j): float(r) for j, r in enumerate(rewards)}
    for node in sorted(children, key=lambda v: -pos[v]):  # children sit further along than their parent
        values[node] = sum(values[c] for c in children[node]) / len(children[node])
    if len(rewards) == 1:
        values[ROOT] = 0.0
    return TurnTree(paths, values)


@register_advantage("turn", needs_tree=True)
def turn_advantages(
    prompt_ids: Sequence[int],
    responses: Sequence[Sequence[int]],
    trained_masks: Sequence[Sequence[int]],
    rewards: Sequence[float],
    *,
    norm_by_std: bool = True,
    owners: list[list[int]] | None = None,
    eps: float = GRPO_EPS,
) -> TokenAdvantages:
    """Turn credit from the tree (docs/concepts/arpo.md#turn-credit): the tokens between two consecutive nodes of a
    path (:func:`turn_tree`) get ``V(after) - V(before)``, so a path's advantages sum to its reward minus the root's
    value; tool-result tokens get 0.0. Tokens shared by several trajectories lie between the same two nodes and so
    get one advantage, trained once per trajectory (weight 1 per copy, as soft attribution). ``norm_by_std`` divides
    by the group's reward std + ``eps`` (GRPO's scale); equal rewards give exactly 0.0 everywhere.
    """
    weights = [[1.0] * len(r) for r in responses]
    tree = turn_tree(share_keys(prompt_ids, responses, owners), trained_masks, rewards)
    values = [[(b, tree.values[v]) for b, v in path] for path in tree.paths]
    if not rewards_have_spread(list(rewards)):
        return TokenAdvantages([[0.0] * len(r) for r in responses], weights, values)
    scale = group_mean_std(rewards)[1] + eps if norm_by_std else 1.0  # GRPO's scale
    out = []
    for j, path in enumerate(tree.paths):
        row = [0.0] * len(responses[j])
        for (a, u), (b, v) in zip(path, path[1:]):
            adv = (tree.values[v] - tree.values[u]) / scale
            for t in range(a, b):
                row[t] = adv if trained_masks[j][t] else 0.0
        out.append(row)
    return TokenAdvantages(out, weights, values)


@register_advantage_shaper("entropy_aware")
def entropy_aware_advantages(
    adv, entropy, weight, group, num_groups: int, *, coef: float = 0.2, min_multiplier: float | None = None
):
    """AEPO's entropy-aware advantage ``A·(1 + coef·z)`` with ``z`` the per-group z-score of the token entropy.

    ``z = (H - mean) / std`` over the group's trained tokens, each token weighted by ``weight`` (1 per trajectory
    copy for soft attribution; the hard-attribution count weights, so the duplicated and the deduplicated
    computations agree). ``std`` is unbiased (``Σw(H-mean)² / (Σw - 1)``); a zero std, or fewer than two tokens,
    uses 1 (the reference replaces a zero std by 1). ``z`` is detached: the multiplier carries no gradient.

    Args:
        adv: Advantage per token, float tensor [P].
        entropy: Current policy entropy per token [P] (detached inside).
        weight: Count weight per token [P].
        group: Group index per token [P] (long, < num_groups).
        num_groups: Number of groups.
        coef: The entropy weight a (0.2 in AEPO, hard-coded there).
        min_multiplier: Lower bound of ``1 + coef·z`` (None: unclipped, as the reference; 0.0 keeps the sign).

    Returns:
        ``(new_adv, z)``.
    """
    import torch

    h = entropy.detach().double()
    w = weight.double()
    tot_w = torch.zeros(num_groups, dtype=torch.float64, device=h.device).index_add_(0, group, w)
    mean = torch.zeros_like(tot_w).index_add_(0, group, w * h) / tot_w.clamp_min(1e-12)
    dev = h - mean[group]
    var = torch.zeros_like(tot_w).index_add_(0, group, w * dev * dev) / (tot_w - 1).clamp_min(1e-12)
    std = var.sqrt()
    std = torch.where((tot_w > 1) & (std > 0), std, torch.ones_like(std))
    z = (dev / std[group]).to(adv.dtype)
    mult = 1.0 + coef * z
    if min_multiplier is not None:
        mult = mult.clamp_min(min_multiplier)
    return adv * mult, z
