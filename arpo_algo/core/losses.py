"""Per-token policy losses (dual-clip PPO, AEPO entropy-balanced clipping) and the KL estimate.

Every function here works on flat per-token tensors; how tokens are weighted and aggregated (global token mean or
per-sequence mean) is decided by the learner through per-token weights, so the same code serves the duplicated and
the prefix-deduplicated computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from arpo_algo.core.registry import Registry

LOG_RATIO_CLAMP = 20.0  # as the reference: exp() of a huge log-ratio would overflow to inf
KL_CLAMP = 10.0


@dataclass
class PolicyLossOut:
    """Per-token loss and diagnostic flags (bool tensors, same shape as the input).

    Attributes:
        loss: Per-token loss value (to be weighted and summed).
        ratio: Importance ratio ``exp(logp - old_logp)``.
        clipped: The clipped term won on value (``-A·clip(r) > -A·r``), as the reference's ``pg_clipfrac``.
        clipped_grad: Clipped on value yet still receiving gradient (entropy-balanced clipping, A>0, r>1+ε_h).
        dual_clipped: A<0 and the dual-clip bound ``-A·c`` is active (no gradient).
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    clipped_grad: torch.Tensor
    dual_clipped: torch.Tensor


def dual_clip_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    entropy_balanced: bool = False,
) -> PolicyLossOut:
    """Dual-clip PPO per token (reference ``compute_policy_loss``), optionally with AEPO's stop-gradient upper bound.

    ``L = max(-A·r, -A·clip(r, 1-ε_l, 1+ε_h))``, and for ``A < 0`` additionally ``min(L, -A·c)``.

    With ``entropy_balanced`` the upper bound is ``(1+ε_h)/sg(r)·r`` (docs/concepts/aepo.md#entropy-balanced-clipping):
    the same value ``1+ε_h`` in the forward pass, but a clipped positive-advantage token keeps the gradient
    ``-A·(1+ε_h)·∇log π`` instead of 0.

    Args:
        logp: Current log-probabilities (with gradient).
        old_logp: Behaviour log-probabilities (no gradient).
        adv: Advantages per token (no gradient).
        clip_low: ε_l.
        clip_high: ε_h.
        clip_c: Dual-clip constant c (> 1).
        entropy_balanced: Use the stop-gradient upper bound.
    """
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    if entropy_balanced:
        upper = hi / ratio.detach() * ratio
        lower = torch.full_like(ratio, lo)
        clipped_ratio = torch.where(ratio > hi, upper, torch.where(ratio < lo, lower, ratio))
    else:
        clipped_ratio = ratio.clamp(lo, hi)
    l1 = -adv * ratio
    l2 = -adv * clipped_ratio
    loss1 = torch.maximum(l1, l2)
    l3 = -adv * clip_c
    neg = adv < 0
    loss = torch.where(neg, torch.minimum(loss1, l3), loss1)
    clipped = (l2 > l1).detach()
    clipped_grad = clipped & (adv > 0) & (ratio.detach() > hi) if entropy_balanced else torch.zeros_like(clipped)
    dual = (neg & (l3 < loss1)).detach()
    return PolicyLossOut(loss=loss, ratio=ratio.detach(), clipped=clipped, clipped_grad=clipped_grad, dual_clipped=dual)


#: Policy losses by name (``learner.policy_loss``). Each is ``fn(logp, old_logp, adv, settings) -> PolicyLossOut``
#: on flat per-token tensors; ``settings`` is the learner config (read the attributes you need: clip_low, ...).
POLICY_LOSSES = Registry("policy loss", "learner.policy_loss")
register_policy_loss = POLICY_LOSSES.register


@register_policy_loss("dual_clip")
def dual_clip(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, settings: Any) -> PolicyLossOut:
    """:func:`dual_clip_policy_loss` with the settings' ``clip_low``, ``clip_high``, ``clip_c`` and
    ``entropy_balanced_clip`` (AEPO's stop-gradient upper bound)."""
    return dual_clip_policy_loss(
        logp,
        old_logp,
        adv,
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        clip_c=settings.clip_c,
        entropy_balanced=settings.entropy_balanced_clip,
    )


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Low-variance KL estimate ``exp(ref - logp) - (ref - logp) - 1`` per token, clamped to ±10 (reference)."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1.0).clamp(-KL_CLAMP, KL_CLAMP)
