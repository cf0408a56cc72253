"""Tree-sampling decisions for ARPO, AEPO and GRPO: pure functions, no I/O, no engine, no environment.

:class:`arpo_algo.rollout.sampler.TreeSampler` drives the engine and the environments and asks this module every
question that shapes the tree: how many initial samples, whether a trajectory branches after a tool result, how many
fresh samples fill an exhausted prompt, how the tree's nodes look. Keeping these answers pure makes them testable on
hand-written entropy sequences (docs/concepts/arpo.md, docs/concepts/aepo.md). Whether a candidate branches is the
branch-point policy's answer (:mod:`arpo_algo.core.branching`); :func:`num_branches` is the frame it runs in.

Deliberate choices (docs/concepts/reference-choices.md#deliberate-choices), each a named option of :class:`TreeConfig`:

* ``decision_rule="paper"``: after a tool result the trajectory generates ``entropy_tokens`` (k) look-ahead tokens,
  which become the start of its continuation; it branches ``branch_factor`` (Z) times when ``(alpha + beta * dH) *
  penalty > tau``, deterministic. ``"reference"``: the code's rule (docs/concepts/arpo.md#the-reference-rule): right
  after the result, with the entropy of the segment that *ended* with the tool call (one-step lag), each of the Z clones
  is made with probability ``clip(alpha + beta * dH, 0, 1)`` (ARPO) or when ``clip((u + beta * dH) * penalty, 0, 1) >=
  alpha`` (AEPO code), ``u`` from a seeded RNG. ``tau`` is not used by the reference rule (the code merges it with
  alpha).
* Baseline ``H_init``: reset every ``sample()`` call (docs/concepts/arpo.md#entropy-baseline). The paper rule uses the
  trajectory's first segment and branches inherit their parent's baseline; the reference rule gives a branch its own
  first segment after the branch point (as the code's per-index dict does). ``legacy_stale_baseline`` keeps a
  sampler-lifetime dict keyed by the trajectory's index in the batch, reproducing the reference bug.
* Length-truncated trajectories are never branch candidates: requests carry the per-trajectory remaining budget
  (docs/concepts/arpo.md#per-request-budget), so a length finish means the budget is spent and a clone could not
  generate a single token. The reference's candidates come from its shared ``max_tokens`` per round, which we do not
  reproduce.
* ``max_depth`` bounds nesting (a branch of a branch has depth 2); ``None`` is the reference's unbounded tree.
* ``fillup``: ``"batch"`` adds all remaining fresh samples at once when every path of a prompt has ended (paper);
  ``"trickle"`` adds one per round (code, docs/concepts/arpo.md#fill-up).
* AEPO pre-monitoring (docs/concepts/aepo.md#entropy-pre-monitoring): ``m = int(n * sigmoid(0.5 * (H_root - H_tool))) +
  1`` clamped to [1, n]. With ``aepo_premonitor_keep`` the reference's extra discarded trajectory is run to estimate
  ``H_tool``; without it the first initial sample is the probe (see :mod:`arpo_algo.rollout.sampler`), so nothing is
  thrown away.
* AEPO consecutive-branch penalty (docs/concepts/aepo.md#consecutive-branch-penalty): factor ``max(0, 1 - aepo_penalty *
  l)``; ``l`` counts consecutive branching steps of the path (``"path"``, paper) or consecutive rounds in which the
  prompt gained a trajectory, fill-ups included (``"prompt"``, code).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from arpo_algo.core.branching import (
    BRANCH_POLICIES,
    BranchPolicy,
    Candidate,
    PaperRule,
    ReferenceRule,
    UniformDraws,
)
from arpo_algo.core.branching import penalty_factor as penalty_factor  # its home before the policies had one
from arpo_algo.core.entropy import SEGMENT_ENTROPIES
from arpo_base.errors import ConfigError
from arpo_base.options import check_choice, dataclass_from_dict

MODES = ("arpo", "aepo", "grpo")
DECISION_RULES = ("paper", "reference")
FILLUPS = ("batch", "trickle")
PENALTY_SCOPES = ("path", "prompt")
#: Each tree mode's branch policy for each ``decision_rule`` (:mod:`arpo_algo.core.branching`): what the algorithm
#: family changes at the branch point. ``tree.branch_policy`` names any other registered policy.
MODE_POLICIES: dict[str, dict[str, str]] = {
    "arpo": {"paper": "paper", "reference": "reference"},
    "aepo": {"paper": "aepo_paper", "reference": "aepo_reference"},
    "grpo": {"paper": "never", "reference": "never"},
}


@dataclass
class TreeNode:
    """A node of the sampling tree: a run of response tokens [start, end) shared by every trajectory below it."""

    node_id: int
    parent: int | None
    start: int
    end: int
    depth: int
    policy_version: int | None = None  # the weights that sampled it (one version per tree; None: not recorded)


@dataclass(frozen=True)
class TreeConfig:
    """How one prompt's sampling tree grows.

    Attributes:
        mode: "arpo" (entropy branching), "aepo" (ARPO + pre-monitoring/penalty) or "grpo" (independent samples).
        budget: M, trajectories per prompt (exactly this many come out).
        initial: N, initial samples per prompt (AEPO pre-monitoring replaces it with m per prompt).
        branch_factor: Z, clones per branch decision (reference ``beam_size - 1``).
        alpha: Base branch probability (reference ``branch_probability``).
        beta: Entropy weight (reference ``entropy_weight``).
        tau: Threshold of the paper rule.
        entropy_tokens: k, tokens per segment that enter the entropy measure (and the paper rule's look-ahead).
        entropy_method: "full_mean" (mean full entropy of the first k tokens, nats), "full_sum_lnV" (sum of full
            entropies / ln|V|) or "topk_sum_lnV" (reference: entropy over the flattened top-k logprobs of the first
            k tokens / ln|V|, docs/concepts/arpo.md#segment-entropy).
        topk_logprobs: Logprobs per token requested for "topk_sum_lnV" (reference 10); at most what the engine
            returns: 64 with vLLM, the vocabulary with HF (more is refused before any rollout).
        decision_rule: "paper" (branch Z times when alpha + beta * dH > tau, dH from k look-ahead tokens after the
            result) or "reference" (branch with probability alpha + beta * dH, dH from the segment before the call).
        fillup: How fresh samples fill the budget once every path has ended: "batch" (all at once, paper) or
            "trickle" (one per round, reference).
        max_depth: Maximum branch nesting, ``None`` = unbounded (reference).
        branch_policy: A registered branch-point policy (:mod:`arpo_algo.core.branching`) in place of the
            algorithm's rule for ``decision_rule``; ``None`` = that rule ("paper"/"reference", AEPO's with its
            penalty, none for GRPO). Naming a rule that ``decision_rule`` does not select is an error.
        random_rate: p of the "random" branch policy: each possible clone at a candidate is made with probability p
            (one seeded draw each); set it to the entropy arm's measured ``rollout/branches_per_opportunity`` for
            an equal-count control. Refused while another policy is in effect.
        random_lookahead: The "random" branch policy decides after the k look-ahead tokens, as the paper rule does,
            instead of right after the tool result; the clones still start right after the result. Set it when the
            random arm is matched against a look-ahead rule (paper, aepo_paper, appo), so both arms are asked at the
            same moment of the same request sequence. Refused while another policy is in effect.
        appo_threshold: The "appo" policy branches ``cap`` times when its score ``U * L`` exceeds this value (in
            [0, 1]; the score lies in [0, 1)): ``U = 1 - exp(-H)`` of the look-ahead entropy H, ``L = sigmoid(w *
            G)`` of the mean sampled-token log-prob gain G across the tool result
            (docs/concepts/arpo.md#the-appo-score). Refused while another policy is in effect.
        appo_gain_weight: w of the "appo" score's likelihood factor ``L = sigmoid(w * G)``, finite and >= 0; 0
            leaves the look-ahead entropy alone in the score. Refused while another policy is in effect.
        aepo_premonitor: AEPO entropy pre-monitoring (dynamic number of initial samples). Like every ``aepo_*``
            setting it takes effect in mode "aepo" only.
        aepo_premonitor_keep: Estimate ``H_tool`` with the reference's extra discarded trajectory per prompt
            (setting it outside mode "aepo" is an error).
        aepo_premonitor_tokens: Tokens of the reference's ``H_root`` probe (reference 50).
        min_roots: Keep at least this many independent roots per prompt: branching never takes the budget slots
            the missing roots need (fill-ups start them). 0 = off (the paper and the reference).
        aepo_penalty: Consecutive-branch penalty coefficient (reference 0.05, hard-coded there); 0 disables it.
        aepo_penalty_scope: What the consecutive-branch counter follows: "path" (branching steps along a path,
            paper) or "prompt" (rounds in which the prompt gained a trajectory, fill-ups included, code).
        legacy_stale_baseline: Reproduce the reference's never-reset entropy baseline
            (docs/concepts/arpo.md#entropy-baseline).
    """

    mode: str = "arpo"
    budget: int = 8
    initial: int = 4
    branch_factor: int = 1
    alpha: float = 0.5
    beta: float = 0.2
    tau: float = 0.5
    entropy_tokens: int = 20
    entropy_method: str = "full_mean"
    topk_logprobs: int = 10
    decision_rule: str = "paper"
    fillup: str = "batch"
    max_depth: int | None = None
    branch_policy: str | None = None
    random_rate: float = 0.5
    random_lookahead: bool = False
    appo_threshold: float = 0.25
    appo_gain_weight: float = 1.0
    aepo_premonitor: bool = True
    aepo_premonitor_keep: bool = False
    aepo_premonitor_tokens: int = 50
    min_roots: int = 0
    aepo_penalty: float = 0.05
    aepo_penalty_scope: str = "path"
    legacy_stale_baseline: bool = False

    @property
    def premonitor_on(self) -> bool:
        """AEPO pre-monitoring is active (mode "aepo" and ``aepo_premonitor``)."""
        return self.mode == "aepo" and self.aepo_premonitor

    @property
    def penalty(self) -> float:
        """The consecutive-branch penalty coefficient in effect (0 outside mode "aepo")."""
        return self.aepo_penalty if self.mode == "aepo" else 0.0

    @property
    def policy_name(self) -> str:
        """The branch policy in effect: ``branch_policy``, else the mode's rule for ``decision_rule``."""
        return self.branch_policy or MODE_POLICIES[self.mode][self.decision_rule]

    @classmethod
    def from_dict(cls, d: dict) -> TreeConfig:
        """Build from a plain dict; unknown keys (with the closest valid name) and wrong types raise ConfigError."""
        return dataclass_from_dict(cls, d, "tree config").validate()

    @classmethod
    def grpo(cls, budget: int) -> TreeConfig:
        """GRPO: ``budget`` independent trajectories, no branching."""
        return cls(mode="grpo", budget=budget, initial=budget, branch_factor=0)

    @classmethod
    def aepo(cls, budget: int, initial: int, **kw) -> TreeConfig:
        """AEPO with both rollout parts on (pre-monitoring, penalty 0.05: the defaults)."""
        return cls(mode="aepo", budget=budget, initial=initial, **kw)

    def validate(self) -> TreeConfig:
        """Reject impossible or meaningless combinations with a message that explains; returns self."""

        def bad(msg: str, hint: str | None = None) -> None:
            raise ConfigError(f"tree config: {msg}", hint=hint)

        for name, allowed in (
            ("mode", MODES),
            ("decision_rule", DECISION_RULES),
            ("fillup", FILLUPS),
            ("entropy_method", tuple(SEGMENT_ENTROPIES)),
            ("aepo_penalty_scope", PENALTY_SCOPES),
        ):
            check_choice(name, getattr(self, name), allowed, "tree config")
        if self.budget < 1:
            bad(f"budget (M) must be >= 1, got {self.budget}")
        if not 1 <= self.initial <= self.budget:
            bad(
                f"initial (N={self.initial}) must be between 1 and budget (M={self.budget})",
                hint="N initial samples are taken from the budget of M trajectories per prompt",
            )
        if self.branch_factor < 0:
            bad(f"branch_factor (Z) must be >= 0, got {self.branch_factor}")
        if self.mode == "grpo" and (self.branch_factor != 0 or self.initial != self.budget):
            bad(
                f"mode='grpo' samples M independent trajectories: needs branch_factor=0 and initial=budget "
                f"(got Z={self.branch_factor}, N={self.initial}, M={self.budget})",
                hint="use TreeConfig.grpo(M)",
            )
        for name in ("alpha", "tau"):
            v = getattr(self, name)
            if not (0.0 <= v <= 1.0):
                bad(f"{name} must be in [0, 1] (it is a probability / probability threshold), got {v}")
        if not 0.0 <= self.random_rate <= 1.0:  # NaN fails this test too
            bad(
                f"random_rate must be in [0, 1] (the probability of each possible clone), got {self.random_rate}",
                hint="set it to the entropy arm's rollout/branches_per_opportunity for an equal-count control",
            )
        if not isinstance(self.random_lookahead, bool):
            bad(f"random_lookahead must be true or false, got {self.random_lookahead!r}")
        if not 0.0 <= self.appo_threshold <= 1.0:  # NaN fails this test too
            bad(
                f"appo_threshold must be in [0, 1] (the appo score U * L lies in [0, 1)), got {self.appo_threshold}",
                hint="0 branches at every candidate with any look-ahead entropy, 1 never",
            )
        if not (math.isfinite(self.appo_gain_weight) and self.appo_gain_weight >= 0.0):
            bad(
                f"appo_gain_weight must be a finite number >= 0 (the weight of the log-prob gain), "
                f"got {self.appo_gain_weight}",
                hint="0 scores the look-ahead entropy alone",
            )
        if not (math.isfinite(self.beta) and self.beta >= 0.0):
            bad(f"beta must be a finite number >= 0 (entropy weight), got {self.beta}")
        if self.entropy_tokens < 1:
            bad(f"entropy_tokens (k) must be >= 1, got {self.entropy_tokens}")
        if self.entropy_method == "topk_sum_lnV" and self.topk_logprobs < 1:
            bad(f"entropy_method='topk_sum_lnV' needs topk_logprobs >= 1, got {self.topk_logprobs}")
        if self.max_depth is not None and self.max_depth < 1:
            bad(
                f"max_depth must be None (unbounded) or >= 1, got {self.max_depth}",
                hint="to disable branching set branch_factor=0",
            )
        if not 0.0 <= self.aepo_penalty <= 1.0:
            bad(f"aepo_penalty must be in [0, 1], got {self.aepo_penalty}")
        if not 0 <= self.min_roots <= self.budget:
            bad(f"min_roots must be between 0 and budget (M={self.budget}), got {self.min_roots}")
        if self.aepo_premonitor_tokens < 1:
            bad(f"aepo_premonitor_tokens must be >= 1, got {self.aepo_premonitor_tokens}")
        if self.mode != "aepo" and self.aepo_premonitor_keep:
            bad(f"aepo_premonitor_keep is an AEPO setting but mode={self.mode!r}", hint="set mode='aepo'")
        if self.aepo_premonitor_keep and not self.aepo_premonitor:
            bad("aepo_premonitor_keep=True needs aepo_premonitor=True")
        if self.branch_policy is not None:
            self._check_branch_policy(bad)
        for k in self.unread_knobs():  # a setting that is accepted acts: a policy's own knobs only with that policy
            readers = [n for n, cls in BRANCH_POLICIES.items() if k in getattr(cls, "own_knobs", ())]
            bad(
                f"{k}={getattr(self, k)!r} is read only by branch_policy {' or '.join(map(repr, readers))}, and "
                f"this tree's policy is {self.policy_name!r}",
                hint=f"set branch_policy = {readers[0]!r}, or leave {k} unset",
            )
        return self

    def unread_knobs(self) -> list[str]:
        """The settings a registered policy alone reads (its ``own_knobs``) set away from their defaults while
        another policy is in effect: they would change nothing."""
        own = getattr(BRANCH_POLICIES.get(self.policy_name), "own_knobs", ())
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [
            k
            for name, cls in BRANCH_POLICIES.items()
            for k in getattr(cls, "own_knobs", ())
            if name != self.policy_name and k not in own and getattr(self, k) != defaults[k]
        ]

    def without_unread_knobs(self) -> TreeConfig:
        """This config with :meth:`unread_knobs` back at their defaults (arms of a comparison that share overrides)."""
        defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: defaults[k] for k in self.unread_knobs()})

    def _check_branch_policy(self, bad: Callable[..., None]) -> None:
        """Invariant: one setting selects each rule: ``decision_rule`` picks the algorithm's paper or reference rule,
        ``branch_policy`` any other registered policy, and the two never disagree."""
        BRANCH_POLICIES.check(self.branch_policy, "tree config")
        own = MODE_POLICIES[self.mode]
        rules = {name for rules in MODE_POLICIES.values() for name in rules.values()}
        if self.branch_policy in rules and self.branch_policy != own[self.decision_rule]:
            rule = next((r for r, name in own.items() if name == self.branch_policy), None)
            bad(
                f"branch_policy={self.branch_policy!r} contradicts decision_rule={self.decision_rule!r}, which "
                f"selects {own[self.decision_rule]!r} in mode {self.mode!r}",
                hint=f"leave branch_policy unset and set decision_rule={rule!r}"
                if rule
                else "leave branch_policy unset: decision_rule selects the algorithm's own rule",
            )


# ----------------------------------------------------------------------------------------------------------- seeds
def derive_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from (seed, step, prompt, trajectory, ...): the same parts always give the same seed."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(str(p).encode() if isinstance(p, str) else struct.pack("<q", int(p)))
        h.update(b"|")
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def tools_seed(seed: int, step: int, prompt_index: int, trajectory: int) -> int:
    """The seed a root trajectory's persistent interpreters draw ``random`` and numpy from. Training, evaluation and
    serving all use it, so an evaluation run or a seeded served choice sees the draws training gives the same
    (seed, step, prompt, trajectory); a branch continues its parent's state instead."""
    return derive_seed(seed, step, prompt_index, "tools", trajectory)


def branch_rng(seed: int, step: int, prompt_index: int) -> random.Random:
    """The RNG of one prompt's reference-rule branch draws (independent of other prompts and of batching)."""
    return random.Random(derive_seed(seed, step, prompt_index, "branch"))


# --------------------------------------------------------------------------------------------------------- entropy
def segment_entropy(
    entropies: Sequence[float],
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None,
    method: str,
    k: int,
    vocab_size: int,
) -> float:
    """The entropy value the branch rule sees for one generated segment (its first ``k`` tokens).

    Args:
        entropies: Per-token full entropies (nats) of the segment.
        top_logprobs: Per-token top-k (token_id, logprob) pairs (needed by "topk_sum_lnV").
        method: A name in :data:`arpo_algo.core.entropy.SEGMENT_ENTROPIES` (:attr:`TreeConfig.entropy_method`).
        k: Tokens taken from the start of the segment.
        vocab_size: |V| for the ln|V| normalisation.

    Returns:
        0.0 for an empty segment (as the reference's empty sum).
    """
    return SEGMENT_ENTROPIES.lookup(method)(entropies, top_logprobs, k, vocab_size)


# ------------------------------------------------------------------------------------------------------------ AEPO
def aepo_initial_samples(n: int, h_root: float, h_tool: float) -> int:
    """AEPO pre-monitoring: ``m = int(n * sigmoid(0.5 * (h_root - h_tool))) + 1`` clamped to [1, n]
    (docs/concepts/aepo.md#entropy-pre-monitoring)."""
    x = 0.5 * (h_root - h_tool)
    sig = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    return max(1, min(n, int(n * sig) + 1))


def next_prompt_consecutive(consecutive: int, gained: bool) -> int:
    """Per-prompt penalty counter after a round (code scope): +1 if the prompt gained a trajectory, else 0."""
    return consecutive + 1 if gained else 0


# -------------------------------------------------------------------------------------------------------- branching
def branch_policy(cfg: TreeConfig) -> BranchPolicy:
    """The branch-point policy of ``cfg`` (:attr:`TreeConfig.policy_name`), built with ``cfg``."""
    return BRANCH_POLICIES.lookup(cfg.policy_name)(cfg)


def paper_decision(cfg: TreeConfig, delta_h: float, consecutive: int) -> bool:
    """Paper rule: branch iff ``(alpha + beta * dH) * penalty > tau`` (deterministic; the penalty acts in AEPO)."""
    rule = BRANCH_POLICIES.lookup(MODE_POLICIES[cfg.mode]["paper"])(cfg)
    return bool((rule if hasattr(rule, "decide") else PaperRule(cfg)).decide(delta_h, consecutive))


def reference_decision(cfg: TreeConfig, delta_h: float, consecutive: int, u: float) -> bool:
    """Reference rule for one clone, with ``u ~ U[0, 1)``: ARPO's or AEPO's code
    (:class:`~arpo_algo.core.branching.ReferenceRule`, :class:`~arpo_algo.core.branching.AEPOReferenceRule`)."""
    rule = BRANCH_POLICIES.lookup(MODE_POLICIES[cfg.mode]["reference"])(cfg)
    return bool((rule if hasattr(rule, "clone") else ReferenceRule(cfg)).clone(delta_h, consecutive, u))


def num_branches(
    cfg: TreeConfig,
    delta_h: float,
    depth: int,
    consecutive: int,
    free: int,
    rng: UniformDraws | None,
    *,
    policy: BranchPolicy | None = None,
    h_init: float | None = None,
    h_now: float | None = None,
    h_before: float | None = None,
    logprobs: Sequence[float] | None = None,
    lookahead_logprobs: Sequence[float] | None = None,
) -> int:
    """How many clones one candidate makes at one tool result: the frame every branch policy runs in.

    Args:
        cfg: The tree config.
        delta_h: ``H_now - H_init`` of the candidate.
        depth: The candidate's branch depth (0 for initial samples and fill-ups).
        consecutive: The AEPO penalty counter ``l`` that applies (path or prompt scope).
        free: Budget still free for this prompt.
        rng: The prompt's branch RNG (one draw per potential clone under the reference rule, as the code).
        policy: The policy to ask (default: :func:`branch_policy` of ``cfg``).
        h_init, h_now, h_before, logprobs, lookahead_logprobs: The rest of the
            :class:`~arpo_algo.core.branching.Candidate`.

    Returns:
        A number in ``[0, min(Z, free)]``; 0 when the depth limit is reached (the policy is not asked).
    """
    cap = min(cfg.branch_factor, free)
    if cap <= 0 or (cfg.max_depth is not None and depth + 1 > cfg.max_depth):
        return 0
    policy = policy if policy is not None else branch_policy(cfg)
    c = Candidate(delta_h, depth, consecutive, free, cap, rng, h_init, h_now, h_before, logprobs, lookahead_logprobs)
    return max(0, min(cap, int(policy.branches(c))))


def fillup_count(cfg: TreeConfig, count: int, has_active: bool) -> int:
    """Fresh samples to add for a prompt after a round: none while any path is alive; otherwise all (batch) or one
    (trickle) of the remaining budget."""
    free = cfg.budget - count
    if has_active or free <= 0:
        return 0
    return free if cfg.fillup == "batch" else 1


# ------------------------------------------------------------------------------------------------------------- tree
def build_tree(
    parents: Sequence[int | None], branch_points: Sequence[int | None], lengths: Sequence[int]
) -> tuple[list[TreeNode], list[list[int]]]:
    """The sampling tree of one group from each trajectory's parent, branch point and response length.

    Node 0 is the root (the prompt, an empty token run). Each trajectory's own tokens ``[branch_point, length)`` are
    split at the branch points of its children, so every node is a token run shared by all trajectories below it.

    Returns:
        ``(nodes, node_ids)``: the nodes, and per trajectory its node ids root first.
    """
    n = len(parents)
    cuts: list[set[int]] = [set() for _ in range(n)]
    for t in range(n):
        p, bp = parents[t], branch_points[t]
        if p is not None:
            if bp is None:
                raise ValueError(f"trajectory {t}: it has parent {p} but no branch point")
            if not (p < t and (branch_points[p] or 0) <= bp <= lengths[p]):
                raise ValueError(f"trajectory {t}: parent {p} must precede it and own its branch point")
            cuts[p].add(bp)
    nodes = [TreeNode(node_id=0, parent=None, start=0, end=0, depth=0)]
    paths: list[list[int]] = []
    for t in range(n):
        p, bp = parents[t], branch_points[t]
        if p is None:
            path, start = [0], 0
        else:
            assert bp is not None, "the loop above refused a child without a branch point"
            # the parent's node that ends exactly at the branch point (the root when bp == 0)
            path = [nid for nid in paths[p] if nodes[nid].end <= bp]
            start = bp
        for end in sorted(c for c in cuts[t] if start < c < lengths[t]) + [lengths[t]]:
            node = TreeNode(node_id=len(nodes), parent=path[-1], start=start, end=end, depth=len(path))
            nodes.append(node)
            path = path + [node.node_id]
            start = end
        paths.append(path)
    return nodes, paths
