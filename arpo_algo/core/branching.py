"""Branch-point policies: where a sampling tree branches, one protocol and one registry.

:class:`arpo_algo.rollout.sampler.TreeSampler` asks a policy at every candidate (a live trajectory right after a tool
result: once the k look-ahead tokens are in for a ``lookahead`` policy, before the next generation otherwise). The
frame around the policy is fixed: a candidate reaches it only while the prompt has free budget and the depth limit
allows a branch, and its answer is clipped to ``[0, cap]``. A new policy is one class and one registration line
(``examples/extend/branch_policy.py``)::

    from arpo_algo.core.branching import Candidate, register_branch_policy

    @register_branch_policy("always")
    class Always:
        lookahead = False          # decide right after the tool result (True: after k look-ahead tokens)
        fresh_baseline = False     # a clone keeps its parent's entropy baseline H_init
        needs_logprobs = False     # True: Candidate.logprobs (and lookahead_logprobs) hold sampled-token log-probs

        def __init__(self, cfg): self.cfg = cfg               # the TreeConfig (alpha, beta, tau, ...)
        def branches(self, c: Candidate) -> int: return c.cap

and ``tree.branch_policy = "always"`` selects it. The built-in rules (docs/concepts/arpo.md#the-reference-rule,
docs/concepts/aepo.md#consecutive-branch-penalty) are policies too: ``paper``, ``reference`` (ARPO), ``aepo_paper``,
``aepo_reference`` (AEPO: the same rules with the consecutive-branch penalty), ``never`` (GRPO), ``random`` (the
equal-count control: each clone with probability ``tree.random_rate``, docs/concepts/arpo.md#branch-point-policies)
and ``appo`` (look-ahead uncertainty times log-prob gain, after APPO, docs/concepts/arpo.md#the-appo-score).
Each algorithm's tree mode picks its rule for ``tree.decision_rule`` (:data:`arpo_algo.core.tree.MODE_POLICIES`).

AEPO's pre-monitoring is not a branch policy: it decides how many initial samples a prompt starts with before any
candidate exists, so it stays the ``tree.aepo_premonitor`` knob.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from arpo_algo.core.registry import Registry

#: Branch-point policies by name (``tree.branch_policy``): each entry is a class built with the TreeConfig.
BRANCH_POLICIES = Registry("branch policy", "tree.branch_policy")
register_branch_policy = BRANCH_POLICIES.register


class UniformDraws(Protocol):
    """The branch RNG a policy sees: ``random()`` (a float in ``[0, 1)``) and nothing else, because the sampler
    records each draw for the recorded trees. A ``random.Random`` is one."""

    def random(self) -> float: ...


@dataclass(frozen=True)
class Candidate:
    """One position where the tree may branch, with what a policy may base its answer on.

    Attributes:
        delta_h: ``H_now - H_init``: the entropy change the paper and reference rules weigh.
        depth: The candidate's branch depth (0 for initial samples and fill-ups).
        consecutive: The consecutive-branch count in effect (``tree.aepo_penalty_scope``: the path's or prompt's).
        free: Budget still free for this prompt (min_roots' reserved slots excluded).
        cap: The most clones allowed here, ``min(tree.branch_factor, free)`` (always >= 1 at a policy).
        rng: The prompt's seeded branch RNG (:func:`arpo_algo.core.tree.branch_rng`); a policy draws with
            ``rng.random()`` only (:class:`UniformDraws`), and each draw is recorded.
        h_init: The path's entropy baseline ``H_init`` (its first segment, docs/concepts/arpo.md#entropy-baseline).
        h_now: The entropy the rule sees now, after the tool result: the look-ahead segment (lookahead policies) or
            the segment that ended with the tool call (the reference's one-step lag).
        h_before: Mean full entropy of the last k tokens before the tool result (None when not measured).
        logprobs: The log-probs of the path's sampled tokens before the tool result, in order (tool-result tokens
            left out; policies with ``needs_logprobs`` only).
        lookahead_logprobs: The log-probs of the k look-ahead tokens after the tool result (``lookahead`` policies
            with ``needs_logprobs`` only; empty when the look-ahead produced no token).
    """

    delta_h: float
    depth: int
    consecutive: int
    free: int
    cap: int
    rng: UniformDraws | None = None
    h_init: float | None = None
    h_now: float | None = None
    h_before: float | None = None
    logprobs: Sequence[float] | None = None
    lookahead_logprobs: Sequence[float] | None = None


class BranchPolicy(Protocol):
    """Where the tree branches. Built once per tree config as ``policy(cfg)``."""

    #: True: the sampler generates ``tree.entropy_tokens`` look-ahead tokens after a tool result, then asks (paper).
    lookahead: bool
    #: True: a clone measures its own baseline from its first segment after the branch point (reference code).
    fresh_baseline: bool
    #: True: :attr:`Candidate.logprobs` (and, for a lookahead policy, :attr:`Candidate.lookahead_logprobs`) is filled.
    needs_logprobs: bool

    def branches(self, c: Candidate) -> int:
        """How many clones to make at ``c``: a number in ``[0, c.cap]``."""
        ...


def penalty_factor(coef: float, consecutive: int) -> float:
    """AEPO consecutive-branch penalty factor ``max(0, 1 - coef * l)``."""
    return max(0.0, 1.0 - coef * consecutive)


@register_branch_policy("never")
class Never:
    """GRPO: no candidate ever branches."""

    lookahead, fresh_baseline, needs_logprobs = False, False, False

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def branches(self, c: Candidate) -> int:
        return 0


@register_branch_policy("paper")
class PaperRule:
    """ARPO paper (arXiv 2507.19849, entropy-based adaptive rollout; docs/concepts/arpo.md#the-paper-rule): after k
    look-ahead tokens, branch ``cap`` times iff ``(alpha +
    beta * dH) * penalty > tau`` (deterministic; the penalty factor is 1 here)."""

    lookahead, fresh_baseline, needs_logprobs = True, False, False
    penalty = 0.0  # the consecutive-branch penalty coefficient (AEPO's part)

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def decide(self, delta_h: float, consecutive: int) -> bool:
        cfg = self.cfg
        return (cfg.alpha + cfg.beta * delta_h) * penalty_factor(self.penalty, consecutive) > cfg.tau

    def branches(self, c: Candidate) -> int:
        return c.cap if self.decide(c.delta_h, c.consecutive) else 0


@register_branch_policy("aepo_paper")
class AEPOPaperRule(PaperRule):
    """AEPO (arXiv 2510.14545, consecutive high-entropy branch penalty): the paper rule times the consecutive-branch
    penalty factor ``max(0, 1 - aepo_penalty * l)``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.penalty = cfg.aepo_penalty


@register_branch_policy("reference")
class ReferenceRule:
    """ARPO code (docs/concepts/arpo.md#the-reference-rule): right after the tool result, with the entropy of the
    segment that ended with the call, each of the ``cap`` clones is made iff ``clip(u - beta * dH, 0, 1) <= alpha``
    (probability ``clip(alpha + beta * dH, 0, 1)``), one seeded draw ``u`` per clone."""

    lookahead, fresh_baseline, needs_logprobs = False, True, False

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def clone(self, delta_h: float, consecutive: int, u: float) -> bool:
        """One clone's decision for the draw ``u ~ U[0, 1)``."""
        return min(1.0, max(0.0, u - self.cfg.beta * delta_h)) <= self.cfg.alpha

    def branches(self, c: Candidate) -> int:
        if c.rng is None:
            raise ValueError("the reference decision rule needs the prompt's branch RNG")
        return sum(self.clone(c.delta_h, c.consecutive, c.rng.random()) for _ in range(c.cap))


@register_branch_policy("aepo_reference")
class AEPOReferenceRule(ReferenceRule):
    """AEPO code (docs/concepts/aepo.md#consecutive-branch-penalty): a clone iff ``clip((u + beta * dH) * pf, 0, 1)
    >= alpha``, ``pf`` the consecutive-branch penalty factor."""

    def clone(self, delta_h: float, consecutive: int, u: float) -> bool:
        cfg = self.cfg
        return min(1.0, max(0.0, (u + cfg.beta * delta_h) * penalty_factor(cfg.aepo_penalty, consecutive))) >= cfg.alpha


@register_branch_policy("random")
class RandomRate:
    """The equal-count control (docs/concepts/arpo.md#branch-point-policies): right after the tool result, each of
    the ``cap`` clones is made with probability ``tree.random_rate``, one seeded draw ``u`` per clone (made iff ``u <
    rate``), whatever the entropy. The expected branches per candidate are ``rate * cap``, so setting the rate to an
    entropy arm's measured ``rollout/branches_per_opportunity`` matches its branch count on the same candidates.
    ``tree.random_lookahead`` moves the decision after the k look-ahead tokens, where a look-ahead rule decides (the
    clones start right after the tool result either way); the draws are the same."""

    lookahead, fresh_baseline, needs_logprobs = False, False, False
    #: The tree settings only this policy reads: set for another policy, they are refused.
    own_knobs = ("random_rate", "random_lookahead")

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.lookahead = bool(cfg.random_lookahead)  # when the sampler asks: read per config, so per instance

    def branches(self, c: Candidate) -> int:
        if c.rng is None:
            raise ValueError("the random branch policy needs the prompt's branch RNG")
        rate = self.cfg.random_rate
        return sum(c.rng.random() < rate for _ in range(c.cap))


def mean_logprob_gain(before: Sequence[float], after: Sequence[float], k: int) -> float:
    """``G = mean(after[:k]) - mean(before[-k:])``: how much more likely, per token, the policy found the first ``k``
    tokens it sampled after a tool result than the last ``k`` it sampled before it (nats, ``k >= 1``; 0 when either
    is empty)."""
    head, tail = list(after[:k]), list(before[-k:])
    if not head or not tail:
        return 0.0
    return sum(head) / len(head) - sum(tail) / len(tail)


def appo_score(h_now: float, gain: float, weight: float) -> float:
    """The ``appo`` score ``U * L`` in [0, 1): uncertainty ``U = 1 - exp(-H_now)`` (0 for a certain look-ahead,
    towards 1 as its entropy grows) times likelihood factor ``L = sigmoid(weight * gain)`` (1/2 at no gain)."""
    u = 1.0 - math.exp(-max(0.0, h_now))
    x = weight * gain
    lik = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    return u * lik


@register_branch_policy("appo")
class APPOScore:
    """After APPO (arXiv 2606.12384, docs/concepts/arpo.md#the-appo-score): after the k look-ahead tokens, branch
    ``cap`` times iff ``appo_score(H_now, G, tree.appo_gain_weight) > tree.appo_threshold``, with ``H_now`` the
    look-ahead's entropy and ``G`` the mean sampled-token log-prob gain across the tool result
    (:func:`mean_logprob_gain`, k = ``tree.entropy_tokens``). Deterministic: it draws nothing from the branch RNG.
    APPO scores every token of finished rollouts with the policy's importance ratio; this scores the same post-tool
    candidates as the other policies, from what the sampling policy measured there."""

    lookahead, fresh_baseline, needs_logprobs = True, False, True
    #: The tree settings only this policy reads: set for another policy, they are refused.
    own_knobs = ("appo_threshold", "appo_gain_weight")

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def gain(self, c: Candidate) -> float:
        """``G`` at ``c`` (0 without log-probs)."""
        return mean_logprob_gain(c.logprobs or (), c.lookahead_logprobs or (), self.cfg.entropy_tokens)

    def score(self, c: Candidate) -> float:
        """``U * L`` at ``c``."""
        if c.h_now is None:
            raise ValueError("the appo branch policy needs the look-ahead entropy H_now")
        return appo_score(c.h_now, self.gain(c), self.cfg.appo_gain_weight)

    def branches(self, c: Candidate) -> int:
        return c.cap if self.score(c) > self.cfg.appo_threshold else 0
