"""Entropy estimators on hand-made distributions."""

from __future__ import annotations

import math

import pytest
import torch

from arpo_algo.core.entropy import token_entropy, topk_sum_lnV, topk_token_term
from arpo_algo.core.tree import segment_entropy
from arpo_algo.rollout.engines.base import Generation
from arpo_env.errors import ConfigError


def test_uniform_is_ln_v_and_one_hot_is_zero():
    for v in (2, 7, 259, 151_665):
        assert token_entropy(torch.zeros(v)).item() == pytest.approx(math.log(v), rel=1e-5)
    assert token_entropy(torch.tensor([0.0, -math.inf, -math.inf])).item() == 0.0  # masked logits: 0, not NaN
    assert token_entropy(torch.tensor([1000.0, 0.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)


def test_batched_and_temperature():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 0.0, -1.0]])
    h = token_entropy(logits)
    p = torch.softmax(logits[1], -1)
    assert h.shape == (2,) and h[0].item() == pytest.approx(math.log(4))
    assert h[1].item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-6)
    # higher temperature flattens the distribution: entropy goes up; temperature 0 means the raw distribution
    assert token_entropy(logits[1], 2.0) > h[1] and token_entropy(logits[1], 0.0) == pytest.approx(h[1])
    assert token_entropy(logits.to(torch.bfloat16)).dtype == torch.float32


def test_topk_sum_lnv_hand_computed():
    # two tokens: top-2 lists; the second token's sampled id 9 was outside its top-2 and is appended (as vLLM does)
    t1 = [(1, math.log(0.5)), (2, math.log(0.25))]
    t2 = {3: math.log(0.6), 4: math.log(0.3), 9: math.log(0.1)}
    h = -(0.5 * math.log(0.5) + 0.25 * math.log(0.25) + 0.6 * math.log(0.6) + 0.3 * math.log(0.3)
          + 0.1 * math.log(0.1))
    assert topk_sum_lnV([t1, t2], vocab_size=100) == pytest.approx(h / math.log(100))
    # a sum over positions, not a mean: only the first k tokens count
    assert topk_sum_lnV([t1, t2, t2], vocab_size=100, k=2) == pytest.approx(h / math.log(100))
    assert topk_sum_lnV([t1], vocab_size=100) == pytest.approx(topk_token_term(t1) / math.log(100))
    assert topk_sum_lnV([[math.log(0.5), math.log(0.5)]], vocab_size=4) == pytest.approx(math.log(2) / math.log(4))
    assert topk_sum_lnV([], vocab_size=10) == 0.0
    with pytest.raises(ConfigError):
        topk_sum_lnV([t1], vocab_size=1)


def test_segment_entropy_methods():
    """The branch rule's segment entropy (arpo_algo.core.tree) over engine outputs, both estimator families."""
    gen = Generation("r", [1, 2, 3], [-0.1, -0.2, -0.3], [1.0, 2.0, 6.0], "length",
                     top_logprobs=[[(1, math.log(0.5)), (2, math.log(0.5))]] * 3)
    assert segment_entropy(gen.entropies, gen.top_logprobs, "full_mean", 2, 10) == pytest.approx(1.5)
    assert segment_entropy(gen.entropies, gen.top_logprobs, "topk_sum_lnV", 2, 10) == pytest.approx(
        2 * math.log(2) / math.log(10))
    with pytest.raises(ConfigError, match="entropy_method"):
        segment_entropy(gen.entropies, gen.top_logprobs, "paper", 20, 10)
    with pytest.raises(ConfigError, match="logprobs_topk"):
        segment_entropy(gen.entropies, None, "topk_sum_lnV", 20, 10)
