"""Evaluation statistics over K runs per item: pass@k, maj@k, confidence intervals, paired differences.

Definitions (the reference leaves them open, docs/concepts/reference-choices.md#evaluation-protocol; these are ours,
fixed here):

* **pass@1** = the mean over items of the item's fraction of correct runs (the mean over all K runs). Its 95%
  confidence interval is the normal interval over items, ``mean ± 1.96 · sd(p_i) / sqrt(n)``, with ``p_i`` the item's
  fraction correct: items are the independent units, the K runs of one item are not.
* **pass@k** (every k ≤ K) is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code", eq. 1): per item with n runs of which c are correct, ``1 - C(n - c, k) / C(n, k)``, averaged over items. It is
  computed as the product ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no large binomials); it is 1 when ``n - c < k``.
* **maj@k** = majority vote over the first k runs of each item. Votes are the runs' extracted answers, keyed by
  ``runner.vote_key``; runs without an answer do not vote. **Tie rule:** among answers with the most votes, the one
  whose first vote came earliest (the lowest run index) wins; so maj@1 is the first run's correctness. The item
  counts as correct when the winning answer's first run was correct; with no votes at all it is wrong.
* **Paired difference** of two models on the same items and seeds: per item ``p_i(B) - p_i(A)``; the point estimate is
  its mean and the 95% interval comes from a seeded bootstrap over items (2,000 resamples, percentiles 2.5 and 97.5).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

__all__ = ["pass_at_k", "mean_pass_at_k", "maj_vote", "mean_ci", "paired_bootstrap", "Z95"]

Z95 = 1.959963984540054
BOOTSTRAP_SAMPLES = 2000


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one item with ``n`` runs, ``c`` of them correct (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over items; ``correct[i]`` holds item i's runs (each item needs at least k runs)."""
    if not correct:
        return 0.0
    return sum(pass_at_k(len(runs), sum(bool(x) for x in runs), k) for runs in correct) / len(correct)


def maj_vote(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> tuple[str | None, bool]:
    """(winning answer, whether it is correct) over the first ``k`` runs; see the tie rule in the module docstring."""
    votes: dict[str, list[int]] = {}
    for i, (ans, _) in enumerate(zip(answers[:k], correct[:k])):
        if ans is None:
            continue
        votes.setdefault(ans, []).append(i)
    if not votes:
        return None, False
    winner = min(votes, key=lambda a: (-len(votes[a]), votes[a][0]))
    return winner, bool(correct[votes[winner][0]])


def mean_ci(values: Sequence[float]) -> dict[str, float]:
    """Mean and normal 95% interval half-width over independent units (0 width for fewer than 2 units)."""
    n = len(values)
    if n == 0:
        return {"mean": 0.0, "ci95": 0.0, "n": 0}
    m = sum(values) / n
    if n < 2:
        return {"mean": m, "ci95": 0.0, "n": n}
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    return {"mean": m, "ci95": Z95 * math.sqrt(var / n), "n": n}


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], *, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0
) -> dict[str, Any]:
    """Mean of ``b - a`` over paired items with a seeded bootstrap 95% interval and P(diff <= 0) under resampling."""
    if len(a) != len(b):
        raise ValueError(f"paired_bootstrap needs equal lengths, got {len(a)} and {len(b)}")
    n = len(a)
    if n == 0:
        return {"diff": 0.0, "lo": 0.0, "hi": 0.0, "n": 0, "p_le_0": 1.0}
    d = [y - x for x, y in zip(a, b)]
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(samples))
    lo = means[int(0.025 * (samples - 1))]
    hi = means[int(math.ceil(0.975 * (samples - 1)))]
    return {"diff": sum(d) / n, "lo": lo, "hi": hi, "n": n, "p_le_0": sum(m <= 0 for m in means) / samples}
