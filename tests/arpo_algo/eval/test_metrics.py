"""pass@k (Chen et al. 2021) against hand-computed values and brute force, maj@k ties, intervals, paired bootstrap."""

from __future__ import annotations

import itertools
import math

import pytest

from arpo_algo.eval.metrics import maj_vote, mean_ci, mean_pass_at_k, paired_bootstrap, pass_at_k


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),  # c = 0: never
        (5, 5, 1, 1.0),
        (5, 5, 5, 1.0),  # all correct
        (4, 1, 1, 0.25),  # pass@1 = c / n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 4, 1.0),
        (4, 1, 4, 1.0),  # k = n: correct iff any run is
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (3, 1, 2, 2 / 3),  # 1 - C(2,2)/C(3,2)
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_subset_probability():
    """Brute force: the fraction of k-subsets of the n runs holding a correct run."""
    for n in range(1, 8):
        for c in range(n + 1):
            runs = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(runs, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="got n=3, c=4, k=1"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="got n=3, c=1, k=4"):
        pass_at_k(3, 1, 4)


def test_mean_pass_at_k_over_items():
    items = [[True, False, False, False], [False] * 4, [True] * 4]
    assert mean_pass_at_k(items, 1) == pytest.approx((0.25 + 0 + 1) / 3)
    assert mean_pass_at_k(items, 4) == pytest.approx((1 + 0 + 1) / 3)


def test_maj_vote_majority_and_ties():
    answers = ["a", "b", "b", "a"]
    correct = [False, True, True, False]
    assert maj_vote(answers, correct, 3) == ("b", True)  # 2 votes against 1
    assert maj_vote(answers, correct, 4) == ("a", False)  # tie 2-2: the earliest first vote ("a", run 0) wins
    assert maj_vote(["b", "a", "a", "b"], [True, False, False, True], 4) == ("b", True)  # same tie, other order
    assert maj_vote(answers, correct, 1) == ("a", False)  # maj@1 = the first run
    assert maj_vote([None, None, "x"], [False, False, True], 3) == ("x", True)  # runs without an answer do not vote
    assert maj_vote([None, None], [False, False], 2) == (None, False)


def test_mean_ci_hand_computed():
    ci = mean_ci([0.0, 1.0])
    assert ci["mean"] == 0.5
    assert ci["ci95"] == pytest.approx(1.959963984540054 * math.sqrt(0.5 / 2))
    assert mean_ci([1.0]) == {"mean": 1.0, "ci95": 0.0, "n": 1}
    assert mean_ci([0.25] * 10)["ci95"] == 0.0


def test_paired_bootstrap():
    same = paired_bootstrap([0.5, 0.0, 1.0], [0.5, 0.0, 1.0])
    assert same["diff"] == 0 and same["lo"] == 0 and same["hi"] == 0
    better = paired_bootstrap([0.0] * 20, [1.0] * 20)
    assert better["diff"] == 1 and better["lo"] == 1 and better["p_le_0"] == 0
    mixed = paired_bootstrap([0.0] * 10 + [1.0] * 10, [1.0] * 10 + [1.0] * 10, seed=1)
    assert mixed["diff"] == pytest.approx(0.5)
    assert 0.2 < mixed["lo"] < 0.5 < mixed["hi"] <= 0.8
    assert paired_bootstrap([0.0, 1.0], [1.0, 0.0], seed=3) == paired_bootstrap([0.0, 1.0], [1.0, 0.0], seed=3)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_bootstrap([1.0], [1.0, 0.0])


def test_majority_votes_keep_different_numbers_apart():
    """Bug: votes were keyed by the QA normalisation, which drops punctuation: -6000000 voted with 6000000 (and
    261.20 with 2612.0), so two wrong answers could hand the correct one's majority to the wrong value or back."""
    from arpo_algo.eval.runner import rule_scores

    texts = ["\\boxed{-6000000}", "\\boxed{6000000}", "\\boxed{6,000,000}", "\\boxed{-6,000,000}", "\\boxed{ -6e6 }"]
    rows = [rule_scores(t, "-6000000", {}) for t in texts]
    keys = [r["answer_norm"] for r in rows]
    assert keys[0] == keys[3] == keys[4] and keys[1] == keys[2] and keys[0] != keys[1]
    correct = [bool(r["math_equiv"]) for r in rows]
    assert correct == [True, False, False, True, True]
    assert maj_vote(keys[:3], correct[:3], 3) == (keys[1], False)  # 2 votes for 6000000 against 1: wrong
    assert (
        rule_scores("\\boxed{261.20}", "2612", {})["answer_norm"]
        != rule_scores("\\boxed{2612.0}", "2612", {})["answer_norm"]
    )
    assert (
        rule_scores("\\boxed{The Eiffel Tower}", "x", {})["answer_norm"]
        == rule_scores("\\boxed{eiffel tower.}", "x", {})["answer_norm"]
    )  # text answers: the QA normalisation
