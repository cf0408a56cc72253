"""The mismatch alarm's arithmetic: the sampler's log-probs against the learner's for the same sampled tokens.

:func:`local_sums` adds up one rank's share; the learner reduces the sums over its ranks and :func:`judge` compares
the statistics with their levels (raise above a stop level, warn above a warning level or when ``kl_rollout`` keeps
rising). Invariant: with the engine holding the learner's weights and sampling the distribution the learner scores,
the two agree up to kernel rounding; anything more means the update would be computed off-policy.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from arpo_algo.core.losses import k3_kl
from arpo_algo.train.learner_config import GROWTH_FACTOR, GROWTH_WINDOW
from arpo_base.errors import ArpoError

log = logging.getLogger("arpo_algo.train.learner")


@dataclass
class Sums:
    """One rank's share of the statistics (weighted k3 KL and weight, worst |difference|, token counts, and per
    trajectory its k3 sum and weight)."""

    kl_sum: float = 0.0
    weight: float = 0.0
    worst: float = 0.0
    count: int = 0
    bad: int = 0
    tail: int = 0
    traj_kl: dict[int, list[float]] = field(default_factory=dict)


def local_sums(batches: list[Any], current: list[torch.Tensor], tail_diff: float) -> Sums:
    """The sums over this rank's sampled tokens (an unsampled position, explicitly marked, is left out; a non-finite
    sampler log-prob at a sampled position is counted as bad)."""
    s = Sums()
    for b, cur in zip(batches, current):
        sampled = b.pair_sampled  # False: a token the sampler appended without sampling it (explicitly marked)
        finite = torch.isfinite(b.pair_old_logp)
        s.bad += int((sampled & ~finite).sum())
        sampled = sampled & finite
        if not bool(sampled.any()):
            continue
        # float64: in float32, exp(d) - d - 1 cancels to 0 below |d| ~ 1e-4 and hides the rounding-level noise
        q, p, w = b.pair_old_logp[sampled].double(), cur[sampled].double(), b.pair_weight[sampled].double()
        k3 = w * k3_kl(q, p)  # samples from q: k3 estimates KL(q || p)
        s.kl_sum += float(k3.sum())
        s.weight += float(w.sum())
        diff = (q - p).abs()
        s.worst = max(s.worst, float(diff.max()))
        s.tail += int((diff > tail_diff).sum())
        s.count += int(sampled.sum())
        for seq, k, ww in zip(b.pair_seq[sampled].tolist(), k3.tolist(), w.tolist()):
            acc = s.traj_kl.setdefault(seq, [0.0, 0.0])
            acc[0] += k
            acc[1] += ww
    return s


def per_token(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], lengths: list[int]) -> list[list[float]]:
    """The learner's log-probs laid out per sequence and response token (NaN where it scored none: a tool-result
    token, or a shared token merged into another trajectory's pair), for the tree recorder. ``parts``: per micro-batch
    its pairs' sequence, response position and scored log-prob, what the update already computed (no forward pass is
    added)."""
    out = [[math.nan] * n for n in lengths]
    for seqs, positions, cur in parts:
        for seq, pos, v in zip(seqs.tolist(), positions.tolist(), cur.float().tolist()):
            out[seq][pos] = v
    return out


def judge(
    cfg: Any,
    precision: str,
    history: list[float],
    *,
    kl: float,
    worst: float,
    count: int,
    bad: int,
    tail_frac: float,
    traj_max: float,
) -> tuple[list[float], bool]:
    """Raise or warn on the reduced statistics; returns the updated ``kl_rollout`` history and whether it grows."""
    if bad:  # an engine that returns NaN must not read as perfect agreement (kl_rollout = 0): a mismatch
        log.error("the rollout engine returned %d non-finite log-prob(s) for %d sampled tokens", bad, bad + count)
        raise ArpoError(
            f"the rollout engine returned {bad} non-finite log-prob(s) for {bad + count} sampled "
            f"tokens: the sampler and the learner disagree; stopping before training on it",
            hint="the engine's log-probs are broken (overflow in its precision, or a kernel fault); "
            "check rollouts.dtype and the engine; a token appended without sampling must be "
            "listed in Trajectory.unsampled",
        )
    warn, stop = cfg.mismatch_levels(precision)
    tails = cfg.tail_levels(precision)
    what = (
        f"the sampler's log-probs disagree with the learner's for the same {count} tokens before any "
        f"update: KL(sampler || learner) = {kl:.3g} (k3), max |log-prob difference| = {worst:.3g}, "
        f"{tail_frac:.3g} of the tokens differ by more than {cfg.tail_logprob_diff:g} nats, the worst "
        f"trajectory's KL = {traj_max:.3g}"
    )
    causes = (
        "usual causes: stale weights (the engine was not sent the last update), a stale batch (sampled "
        "before one of this learner's updates, e.g. update() called again on the same groups, and passed "
        "without behaviour_weights; more passes over one batch are training.ppo_epochs), a sampling temperature "
        "or top-p/top-k the learner does not apply, precision (a bf16 engine or learner against fp32 "
        "levels), a KV cache reused for the wrong context, or an engine that records another kind of "
        "log-prob"
    )
    checks = (
        ("kl_rollout", kl, warn, stop),
        ("tail_frac", tail_frac, *tails["frac"]),
        ("traj_kl", traj_max, *tails["traj"]),
    )
    above_stop = [f"training.{name}_stop = {s:g}" for name, v, _, s in checks if v > s]
    if above_stop:
        raise ArpoError(f"{what}; above {', '.join(above_stop)}, stopping before training on it", hint=causes)
    above_warn = [f"training.{name}_warn = {w:g}" for name, v, w, _ in checks if v > w]
    if above_warn:
        log.warning("%s (above %s); %s", what, ", ".join(above_warn), causes)
    # Growth: a fault that builds up (a cache or weight copy drifting) warns before it reaches a level. Growth
    # below a tenth of the warning level is rounding noise, which rises three times in a row by chance.
    h = (history + [kl])[-(GROWTH_WINDOW + 1) :]
    growing = (
        len(h) == GROWTH_WINDOW + 1
        and all(b > a for a, b in zip(h, h[1:]))
        and h[-1] > GROWTH_FACTOR * h[0]
        and h[-1] > warn / 10
    )
    if growing:
        log.warning(
            "kl_rollout rose over each of the last %d updates, %s -> %s (more than %gx): the sampler "
            "and the learner are drifting apart; %s",
            GROWTH_WINDOW,
            " -> ".join(f"{x:.3g}" for x in h[:-1]),
            f"{h[-1]:.3g}",
            GROWTH_FACTOR,
            causes,
        )
    return h, growing
