"""Rewards: the reference reward (docs/concepts/reference-choices.md#training-reward) on real ground truths,
equivalence, extraction."""

from __future__ import annotations

import doctest

import pyarrow.parquet as pq
import pytest

from arpo_env import rewards
from arpo_env.rewards import REWARDS, arpo_reference, extract_answer, math_equiv, token_f1


def _answer(a: str, tools: str = "") -> str:
    return (
        f"<think>reasoning</think>{tools}<think>done</think> "
        f"<answer> The final answer is \\[ \\boxed{{{a}}} \\] </answer>"
    )


@pytest.fixture(scope="module")
def valid_truths(shared_data):
    rows = pq.read_table(shared_data / "valid.parquet").to_pylist()
    return [(r["ability"], r["reward_model"]["ground_truth"]) for r in rows]


def test_reference_reward_on_real_ground_truths(valid_truths):
    both = " <search> q </search> <result>\nx\n</result> <python> 1 </python> <result>\n1\n</result>"
    assert len(valid_truths) >= 10  # the loop below runs on the real ground truths, not on none
    for _ability, gt in valid_truths:
        score, info = arpo_reference(_answer(gt), gt)
        assert score == pytest.approx(1.0), (gt, info)
        assert arpo_reference(_answer(gt, both), gt)[0] == pytest.approx(1.1)
        assert arpo_reference(_answer(gt).replace("<think>", "", 1), gt)[0] == -1.0  # unbalanced think


def test_reference_format_rules():
    gt = "Paris"
    assert arpo_reference("<think>a</think><answer>Paris</answer>", gt)[0] == -1.0  # no boxed
    assert arpo_reference(_answer("Paris") + "<answer>x</answer>", gt)[0] == -1.0  # two answers
    assert arpo_reference("<think>a</think><search>q</search>" + _answer("Paris")[16:], gt)[0] == -1.0  # no result
    assert arpo_reference(_answer("London"), gt) == (0.0, pytest.approx(arpo_reference(_answer("London"), gt)[1]))
    assert arpo_reference(_answer("Paris") + "<|im_end|>", gt)[0] == 1.0
    assert arpo_reference(_answer("yes"), "no")[0] == 0.0
    # only one tool used: no bonus
    one = " <python> 1 </python> <result>\n1\n</result>"
    assert arpo_reference(_answer("Paris", one), gt)[0] == 1.0


def test_reference_scores_math_by_f1_but_math_equiv_does_not():
    # The reference normalizer strips \{}-, so these equal expressions score 0
    # (docs/concepts/reference-choices.md#training-reward); math_equiv gives 1.
    r = _answer("3\\sqrt{3}-6")
    assert arpo_reference(r, "3\\sqrt{3} - 6")[0] == 0.0
    assert math_equiv(r, "3\\sqrt{3} - 6")[0] == 1.0
    assert math_equiv(_answer("\\frac{1}{2}"), "1/2")[0] == 1.0
    assert math_equiv(_answer("x+1"), "x-1")[0] == 0.0


def test_math_equiv_numbers_and_format_penalty():
    assert math_equiv(_answer("1,234.50"), "1234.5")[0] == 1.0
    assert math_equiv(_answer("261.2"), "261.20", tolerance=0.01)[0] == 1.0
    assert math_equiv(_answer("261.3"), "261.20", tolerance=0.01)[0] == 0.0
    assert math_equiv(_answer("63966921969"), "63966921968", tolerance=0.0)[0] == 0.0
    assert math_equiv("no answer", "5") == (0.0, pytest.approx(math_equiv("no answer", "5")[1]))
    assert math_equiv("no answer", "5", format_penalty=-1.0)[0] == -1.0


def test_extraction():
    assert extract_answer("<answer>a \\boxed{1} then \\boxed{\\frac{2}{3}}</answer>") == "\\frac{2}{3}"
    assert extract_answer("<answer>\\boxed{x}</answer> <answer>\\boxed{\\text{Paris}}</answer>") == "Paris"
    assert extract_answer("no tags \\boxed{7} here") == "7"
    assert extract_answer("<answer>\\boxed{unclosed</answer>") is None
    assert extract_answer("nothing") is None


def test_exact_match_f1_and_registry():
    assert set(REWARDS) == {"arpo_reference", "exact_match", "f1", "math_equiv"}
    assert REWARDS["exact_match"](_answer("The Eiffel Tower"), "eiffel tower")[0] == 1.0
    assert REWARDS["f1"](_answer("Eiffel"), "Eiffel Tower")[0] == pytest.approx(token_f1("Eiffel", "Eiffel Tower"))
    assert 0 < token_f1("Eiffel", "Eiffel Tower") < 1


def test_doctests():
    assert doctest.testmod(rewards).failed == 0
