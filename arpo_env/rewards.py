"""Reward functions over a whole response (all actions and tool results concatenated).

Every reward has the signature ``fn(response, ground_truth, **info) -> (score, breakdown)`` and is selected by name
through :data:`REWARDS` (never by dataset name). ``ground_truth`` may be a string or a list of strings (any match).
Unknown keyword arguments are ignored so the environment can pass task fields (e.g. ``tolerance``) to every reward.

Examples:
    >>> r = "<think>x</think><answer>The answer is \\\\boxed{Paris}</answer>"
    >>> arpo_reference(r, "Paris")[0]
    1.0
    >>> arpo_reference("no tags", "Paris")[0]
    -1.0
    >>> math_equiv("<answer>\\\\boxed{3\\\\sqrt{3}-6}</answer>", "3\\\\sqrt{3} - 6")[0]
    1.0
    >>> extract_answer("<answer>so \\\\boxed{\\\\text{Paris}}</answer>")
    'Paris'
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from arpo_env.tools.registry import tool_tags

RewardFn = Callable[..., tuple[float, dict[str, Any]]]

# Strings the reference strips from the end of a decoded response before extracting the answer.
EOS_STRINGS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")
# The reference's tool bonus asks for a call of both of ITS tools (a rule of that reward, not of every registered tool).
BONUS_TAGS = ("search", "python")


def _as_list(ground_truth: str | Sequence[str]) -> list[str]:
    return [ground_truth] if isinstance(ground_truth, str) else [str(g) for g in ground_truth]


# ------------------------------------------------------------------------------------------- answer extraction


def last_boxed(text: str) -> str | None:
    r"""The last ``\boxed{...}`` (or ``\fbox{...}``, ``\boxed X``) in ``text`` with its wrapper, braces matched."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    if text.startswith("\\boxed ", idx):  # "\boxed 5": the argument runs to the next "$" or whitespace
        return "\\boxed " + re.split(r"[\s$]", text[idx + len("\\boxed ") :], maxsplit=1)[0]
    depth, open_seen = 0, False
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth, open_seen = depth + 1, True
        elif text[i] == "}":
            depth -= 1
            if open_seen and depth == 0:
                return text[idx : i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    r"""Strip the ``\boxed{}`` / ``\fbox{}`` / ``\boxed `` wrapper (raises ValueError when there is none)."""
    for left in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if boxed.startswith(left):
            return boxed[len(left) :] if left.endswith(" ") else boxed[len(left) : -1]
    raise ValueError(f"not a boxed expression: {boxed[:40]!r}")


def _unwrap_text(s: str) -> str:
    # \text{Paris} -> Paris (repeatedly, innermost braces without nesting)
    prev = None
    while prev != s:
        prev, s = s, re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    return s


def extract_answer(text: str) -> str | None:
    r"""Evaluation-style extraction: the last ``<answer>`` span, the last ``\boxed{}`` in it, ``\text{}`` unwrapped.

    Falls back to the last ``\boxed{}`` anywhere in ``text``; ``None`` when there is no boxed answer at all.
    """
    spans = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    boxed = last_boxed(spans[-1]) if spans else None
    if boxed is None:
        boxed = last_boxed(text)
    if boxed is None:
        return None
    try:
        return _unwrap_text(remove_boxed(boxed)).strip()
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------- reference reward


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation, drop articles, collapse whitespace (reference QA normalisation)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: str, ground_truth: str) -> float:
    """Token-level F1 of the normalised strings; yes/no/noanswer must match exactly (reference rule)."""
    pred, gold = normalize_answer(prediction), normalize_answer(ground_truth)
    special = {"yes", "no", "noanswer"}
    if (pred in special or gold in special) and pred != gold:
        return 0.0
    p_toks, g_toks = pred.split(), gold.split()
    common = sum((Counter(p_toks) & Counter(g_toks)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p_toks), common / len(g_toks)
    return 2 * precision * recall / (precision + recall)


def _ordered_pairs_ok(text: str, tag: str) -> bool:
    # Every <tag> must be followed by </tag>, then <result>, then </result>, in that order.
    pos = 0
    while True:
        start = text.find(f"<{tag}>", pos)
        if start < 0:
            return True
        end = text.find(f"</{tag}>", start)
        res = text.find("<result>", start)
        res_end = text.find("</result>", res) if res >= 0 else -1
        if min(end, res, res_end) < 0 or not (start < end < res < res_end):
            return False
        pos = res_end


def validate_format(response: str) -> tuple[bool, str]:
    """The reference format check (docs/concepts/reference-choices.md#training-reward); returns (ok, reason).

    Every registered tool's tag (:mod:`arpo_env.tools.registry`) is checked, the latest registered first (so the
    built-ins in the reference's order: ``<search>`` before ``<python>``)."""
    n_think, n_think_end = response.count("<think>"), response.count("</think>")
    if n_think != n_think_end or n_think == 0:
        return False, "think tags unbalanced or missing"
    if response.count("<answer>") != 1 or response.count("</answer>") != 1:
        return False, "need exactly one <answer> and one </answer>"
    for tag in reversed(tool_tags()):
        if not _ordered_pairs_ok(response, tag):
            return False, f"<{tag}> call without a following <result>"
    start, end = response.find("<answer>"), response.find("</answer>")
    inner = response[start:end]
    if start > end or "\\boxed{" not in inner or "}" not in inner:
        return False, "no \\boxed{} inside <answer>"
    return True, "ok"


def arpo_reference(response: str, ground_truth: str | Sequence[str], **_: Any) -> tuple[float, dict[str, Any]]:
    """The ARPO/AEPO training reward, exactly as the reference (docs/concepts/reference-choices.md#training-reward).

    -1 for bad format; otherwise the best token-F1 of the last boxed answer inside the first ``<answer>`` against
    the ground truths, plus 0.1 when F1 > 0 and both ``</search>`` and ``</python>`` occur in the response.
    Math is scored by token-F1 too (so ``3\\sqrt{3}-6`` vs ``3\\sqrt{3} - 6`` scores 0), as in the reference.
    """
    ok, reason = validate_format(response)
    if not ok:
        return -1.0, {"format_ok": False, "reason": reason, "answer": None, "f1": 0.0, "tool_bonus": 0.0}
    text = response
    for eos in EOS_STRINGS:
        text = text.removesuffix(eos)
    try:
        span = re.search(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
        boxed = last_boxed(span.group(1)) if span else None
        answer = remove_boxed(boxed) if boxed is not None else None
        if answer is None:
            raise ValueError("no boxed answer")
    except ValueError as e:
        return -1.0, {
            "format_ok": False,
            "reason": f"extraction failed: {e}",
            "answer": None,
            "f1": 0.0,
            "tool_bonus": 0.0,
        }
    f1 = max(token_f1(answer, g) for g in _as_list(ground_truth))
    bonus = 0.1 if f1 > 0 and all(f"</{tag}>" in response for tag in BONUS_TAGS) else 0.0
    return f1 + bonus, {"format_ok": True, "reason": "ok", "answer": answer, "f1": f1, "tool_bonus": bonus}


# ----------------------------------------------------------------------------------------- alternatives


def _extracted(response: str, format_penalty: float) -> tuple[str | None, dict[str, Any]]:
    answer = extract_answer(response)
    return answer, {"format_ok": answer is not None, "answer": answer, "format_penalty": format_penalty}


def exact_match(
    response: str, ground_truth: str | Sequence[str], format_penalty: float = 0.0, **_: Any
) -> tuple[float, dict[str, Any]]:
    """1.0 when the extracted answer equals a ground truth after :func:`normalize_answer`, else 0.0.

    A response without a boxed answer scores ``format_penalty`` (default 0.0).
    """
    answer, info = _extracted(response, format_penalty)
    if answer is None:
        return float(format_penalty), info
    score = float(any(normalize_answer(answer) == normalize_answer(g) for g in _as_list(ground_truth)))
    return score, info


def f1(
    response: str, ground_truth: str | Sequence[str], format_penalty: float = 0.0, **_: Any
) -> tuple[float, dict[str, Any]]:
    """Best token-F1 of the extracted answer (no format check, no tool bonus); ``format_penalty`` if none."""
    answer, info = _extracted(response, format_penalty)
    if answer is None:
        return float(format_penalty), info
    score = max(token_f1(answer, g) for g in _as_list(ground_truth))
    return score, {**info, "f1": score}


_NUM_RE = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def parse_number(text: str) -> float | None:
    r"""A plain number from an answer: ``1,234.5``, ``$12``, ``45%``, ``\$3``, ``7 km`` -> float; else None."""
    s = _unwrap_text(text).replace("\\$", "").replace("\\%", "").replace("\\,", "").replace("{,}", "")
    s = s.strip().strip("$").replace(",", "").replace(" ", "").rstrip("%")
    s = re.sub(r"[a-zA-Z]+\.?$", "", s)  # a trailing unit word such as "km" or "dollars"
    return float(s) if _NUM_RE.match(s) else None


def numbers_close(a: float, b: float, tolerance: float | None = None) -> bool:
    """|a - b| <= tolerance (absolute) when given, else a relative 1e-9 comparison."""
    if tolerance is not None:
        return abs(a - b) <= tolerance + 1e-12
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", _unwrap_text(s).lower())


def _symbolic_equal(answer: str, gold: str) -> bool:
    from math_verify import parse, verify  # imported lazily: it pulls in sympy (~1 s)

    try:
        return bool(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{answer}}}")))
    except Exception:  # math_verify raises on unparsable input; that simply means "not equal"
        return False


def math_equiv(
    response: str,
    ground_truth: str | Sequence[str],
    tolerance: float | None = None,
    format_penalty: float = 0.0,
    **_: Any,
) -> tuple[float, dict[str, Any]]:
    """1.0 when the extracted answer equals a ground truth mathematically, else 0.0.

    Plain numbers are compared numerically (``tolerance`` absolute, else relative 1e-9); anything else goes to
    ``math_verify`` (symbolic), then to normalised string equality. A missing boxed answer scores
    ``format_penalty`` (default 0.0; use -1.0 to mimic the reference's bad-format penalty).
    """
    answer, info = _extracted(response, format_penalty)
    if answer is None:
        return float(format_penalty), info
    for gold in _as_list(ground_truth):
        a, b = parse_number(answer), parse_number(gold)
        if a is not None and b is not None:
            if numbers_close(a, b, tolerance):
                return 1.0, {**info, "method": "numeric"}
            continue
        if _squash(answer) == _squash(gold):  # only whitespace/case differ (also covers non-math answers)
            return 1.0, {**info, "method": "string"}
        if _symbolic_equal(answer, gold):
            return 1.0, {**info, "method": "math_verify"}
    return 0.0, {**info, "method": "none"}


REWARDS: dict[str, RewardFn] = {
    "arpo_reference": arpo_reference,
    "exact_match": exact_match,
    "f1": f1,
    "math_equiv": math_equiv,
}
