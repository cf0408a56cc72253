"""Dual-clip PPO, AEPO entropy-balanced clipping, k3 KL and the learning-rate schedule on hand-made numbers."""

from __future__ import annotations

import math

import pytest
import torch

from arpo_algo.core.losses import dual_clip_policy_loss, k3_kl

RATIOS = [0.5, 0.79, 1.0, 1.1, 1.25, 2.0, 3.5, 5.0]


def _hand(r: float, a: float, lo=0.8, hi=1.2, c=3.0) -> float:
    loss = max(-a * r, -a * min(max(r, lo), hi))
    return min(loss, -a * c) if a < 0 else loss


def _run(ratios, advs, **kw):
    logp = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp)
    out = dual_clip_policy_loss(logp, old, torch.tensor(advs, dtype=torch.float64), **kw)
    out.loss.sum().backward()
    return out, logp.grad


@pytest.mark.parametrize("a", [1.5, -0.7])
def test_dual_clip_values_and_gradients(a):
    out, grad = _run(RATIOS, [a] * len(RATIOS))
    assert out.loss.tolist() == pytest.approx([_hand(r, a) for r in RATIOS])
    for r, g, clipped, dual in zip(RATIOS, grad.tolist(), out.clipped.tolist(), out.dual_clipped.tolist()):
        # d(-A r)/d log p = -A r where the unclipped term is active, else 0.
        active = not ((a > 0 and r > 1.2) or (a < 0 and r < 0.8) or (a < 0 and r > 3.0))
        assert g == pytest.approx(-a * r if active else 0.0)
        assert clipped == ((a > 0 and r > 1.2) or (a < 0 and r < 0.8))
        assert dual == (a < 0 and r > 3.0)
    assert not out.clipped_grad.any()


def test_entropy_balanced_clipping_keeps_gradient_above_upper_bound():
    advs = [1.5] * len(RATIOS) + [-0.7] * len(RATIOS)
    ratios = RATIOS + RATIOS
    plain, g_plain = _run(ratios, advs)
    eb, g_eb = _run(ratios, advs, entropy_balanced=True)
    torch.testing.assert_close(eb.loss, plain.loss)  # same forward values
    assert eb.clipped.tolist() == plain.clipped.tolist()  # value-based clipfrac unchanged (reference)
    for r, a, gp, ge, cg in zip(ratios, advs, g_plain.tolist(), g_eb.tolist(), eb.clipped_grad.tolist()):
        if a > 0 and r > 1.2:
            # Gradient w.r.t. log pi is (1 + eps_h) * (-A) instead of 0.
            assert gp == 0.0 and ge == pytest.approx(1.2 * -a) and cg
        else:
            assert ge == pytest.approx(gp) and not cg


def test_ratio_of_one_is_unclipped_policy_gradient():
    out, grad = _run([1.0, 1.0], [2.0, -3.0])
    assert out.loss.tolist() == [-2.0, 3.0] and grad.tolist() == [-2.0, 3.0]


def test_k3_kl():
    logp = torch.tensor([-1.0, -2.0, -0.5, -30.0])
    ref = torch.tensor([-1.0, -1.0, -1.5, -1.0])
    kl = k3_kl(logp, ref)
    d = (ref - logp)[:3]
    assert kl[:3].tolist() == pytest.approx((torch.exp(d) - d - 1).tolist())
    assert kl[0] == 0.0 and (kl >= 0).all() and float(kl[3]) == 10.0  # clamped
