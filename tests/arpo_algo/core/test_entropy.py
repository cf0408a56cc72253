"""Entropy estimators on hand-made distributions."""

from __future__ import annotations

import math

import pytest

from arpo_algo.core.entropy import SEGMENT_ENTROPIES, register_entropy, topk_sum_lnV, topk_token_term
from arpo_algo.core.tree import segment_entropy
from arpo_algo.rollout.engines.base import Generation
from arpo_base.errors import ConfigError


def test_topk_sum_lnv_hand_computed():
    # two tokens: top-2 lists; the second token's sampled id 9 was outside its top-2 and is appended (as vLLM does)
    t1 = [(1, math.log(0.5)), (2, math.log(0.25))]
    t2 = {3: math.log(0.6), 4: math.log(0.3), 9: math.log(0.1)}
    h = -(0.5 * math.log(0.5) + 0.25 * math.log(0.25) + 0.6 * math.log(0.6) + 0.3 * math.log(0.3) + 0.1 * math.log(0.1))
    assert topk_sum_lnV([t1, t2], vocab_size=100) == pytest.approx(h / math.log(100))
    # a sum over positions, not a mean: only the first k tokens count
    assert topk_sum_lnV([t1, t2, t2], vocab_size=100, k=2) == pytest.approx(h / math.log(100))
    assert topk_sum_lnV([t1], vocab_size=100) == pytest.approx(topk_token_term(t1) / math.log(100))
    assert topk_sum_lnV([[math.log(0.5), math.log(0.5)]], vocab_size=4) == pytest.approx(math.log(2) / math.log(4))
    assert topk_sum_lnV([], vocab_size=10) == 0.0
    with pytest.raises(ConfigError, match="vocab_size must be >= 2"):
        topk_sum_lnV([t1], vocab_size=1)


def test_segment_entropy_methods():
    """The branch rule's segment entropy (arpo_algo.core.tree) over engine outputs, both estimator families."""
    gen = Generation(
        "r",
        [1, 2, 3],
        [-0.1, -0.2, -0.3],
        [1.0, 2.0, 6.0],
        "length",
        top_logprobs=[[(1, math.log(0.5)), (2, math.log(0.5))]] * 3,
    )
    assert segment_entropy(gen.entropies, gen.top_logprobs, "full_mean", 2, 10) == pytest.approx(1.5)
    assert segment_entropy(gen.entropies, gen.top_logprobs, "topk_sum_lnV", 2, 10) == pytest.approx(
        2 * math.log(2) / math.log(10)
    )
    with pytest.raises(ConfigError, match="entropy_method: unknown entropy estimator 'paper'") as err:
        segment_entropy(gen.entropies, gen.top_logprobs, "paper", 20, 10)
    assert "full_mean, full_sum_lnV, topk_sum_lnV" in err.value.hint
    with pytest.raises(ConfigError, match="logprobs_topk"):
        segment_entropy(gen.entropies, None, "topk_sum_lnV", 20, 10)


def test_a_new_entropy_estimator_is_one_function_and_one_name():
    from arpo_algo.core.tree import TreeConfig

    @register_entropy("test_max")
    def seg_max(entropies, top_logprobs, k, vocab_size):
        return max(entropies[:k], default=0.0)

    try:
        assert segment_entropy([1.0, 5.0, 9.0], None, "test_max", 2, 10) == 5.0
        assert TreeConfig(entropy_method="test_max").validate().entropy_method == "test_max"
        with pytest.raises(ValueError, match="already registered"):
            register_entropy("test_max")(seg_max)
    finally:
        SEGMENT_ENTROPIES.pop("test_max")
    with pytest.raises(ConfigError, match="entropy_method='test_max' is not one of"):
        TreeConfig(entropy_method="test_max").validate()
