"""Token entropies: exact from full logits, and the ARPO reference estimator from top-k logprobs.

Two estimators exist because the engines see different things (docs/concepts/arpo.md#segment-entropy):

* ``full``: the exact entropy ``H = -sum_v p(v) log p(v)`` (nats) of the full next-token distribution, computed from
  the raw logits (temperature applied, before any top-k/top-p truncation). Never compute it from HF ``generate``'s
  processed ``scores``: those hold ``-inf`` after truncation and give NaN (docs/howto/rllib.md#raw-logits-for-entropy).
* ``topk_sum_lnV``: what the reference code computes from vLLM's top-10 logprobs: flatten the top-k entries (plus
  the sampled token when it is not among them) of the first ``k=20`` generated tokens into one list, take
  ``H = -sum exp(l) * l`` over it (a *sum* over positions, not a mean) and divide by ``ln |V|``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from arpo_algo.core.registry import Registry
from arpo_base.errors import ConfigError

#: Per-token entropy an engine reports: exact ("full") or the reference's top-k summand ("topk_sum_lnV").
ENTROPY_METHODS = ("full", "topk_sum_lnV")

# One token's top-k entries: a mapping token_id -> logprob, a sequence of (token_id, logprob) pairs, or plain floats.
TopLogprobs = Mapping[int, float] | Sequence[tuple[int, float]] | Sequence[float]


def _entries(top: TopLogprobs) -> list[float]:
    if isinstance(top, Mapping):
        return [float(getattr(v, "logprob", v)) for v in top.values()]
    out = []
    for item in top:
        out.append(float(item[1]) if isinstance(item, (tuple, list)) else float(item))
    return out


def topk_token_term(top: TopLogprobs) -> float:
    """One position's contribution ``-sum exp(l) * l`` over its top-k entries (nats, truncated entropy)."""
    return -sum(math.exp(lp) * lp for lp in _entries(top) if lp > -math.inf)


def topk_sum_lnV(top_logprobs_per_token: Sequence[TopLogprobs], vocab_size: int, k: int = 20) -> float:  # noqa: N802
    """The ARPO reference entropy of one generated segment (docs/concepts/arpo.md#segment-entropy).

    Args:
        top_logprobs_per_token: Per generated token, its top-k logprobs *including the sampled token* when it was not
            among the top k (as vLLM returns them and as :attr:`Generation.top_logprobs` holds them).
        vocab_size: ``|V|``; the reference uses ``len(tokenizer.get_vocab())``.
        k: Only the first ``k`` tokens of the segment count (reference: 20).

    Returns:
        ``(-sum over the first k tokens and their entries of exp(l) * l) / ln(vocab_size)``; 0.0 for an empty segment.
    """
    if vocab_size < 2:
        raise ConfigError(f"vocab_size must be >= 2 for topk_sum_lnV, got {vocab_size}")
    if k < 1:
        raise ConfigError(f"entropy k (entropy_tokens) must be >= 1, got {k}")
    total = sum(topk_token_term(top) for top in list(top_logprobs_per_token)[:k])
    return total / math.log(vocab_size)


# ------------------------------------------------------------------------------------------ segment estimators
#: The entropy value the branch rule sees for one generated segment, by ``TreeConfig.entropy_method``. Each entry is
#: ``fn(entropies, top_logprobs, k, vocab_size) -> float`` over the segment's first ``k`` tokens (0.0 when empty).
SEGMENT_ENTROPIES = Registry("entropy estimator", "tree.entropy_method")
register_entropy = SEGMENT_ENTROPIES.register


@register_entropy("full_mean")
def full_mean(entropies: Sequence[float], top_logprobs: object, k: int, vocab_size: int) -> float:
    """Mean full entropy (nats) of the first ``k`` tokens."""
    head = list(entropies[:k])
    return sum(head) / len(head) if head else 0.0


@register_entropy("full_sum_lnV")
def full_sum_lnV(entropies: Sequence[float], top_logprobs: object, k: int, vocab_size: int) -> float:  # noqa: N802
    """Sum of the full entropies of the first ``k`` tokens divided by ``ln |V|``."""
    return sum(entropies[:k]) / math.log(vocab_size)


@register_entropy("topk_sum_lnV")
def topk_segment(
    entropies: Sequence[float], top_logprobs: Sequence[TopLogprobs] | None, k: int, vocab_size: int
) -> float:
    """The reference estimator (:func:`topk_sum_lnV`); needs the engine's top-k logprobs."""
    if top_logprobs is None:
        raise ConfigError("entropy_method='topk_sum_lnV' needs top_logprobs from the engine (logprobs_topk > 0)")
    return topk_sum_lnV(top_logprobs, vocab_size, k)
