"""Stop strings across request boundaries: engine-independent, so every engine stops a turn at the same token.

An engine checks stop strings only in the new tokens of the request it serves (``SamplingParams.stop``). When a turn
is split over several requests (the paper rule's k-token look-ahead, then a continuation), a stop string that starts
in one request and completes in the next is invisible to the engine: in SmolLM2 ``</python>`` is three tokens, so a
look-ahead ending on ``</`` lets the continuation write past the call (a second call, a fake result) and all of it
would be trained on. The sampler therefore re-checks the whole turn after each continuation with
:func:`first_stop_end` and cuts the turn right after the token that completed the first stop string, which is the
token at which an engine that saw the whole turn would have stopped (the completing token is kept, as in
``SamplingParams.stop``). The tokens generated past the cut are wasted compute (counted in ``tokens_generated``);
they are never trained on. Engines need no change for correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def first_stop_end(tokenizer: Any, turn_ids: Sequence[int], n_checked: int, stops: Sequence[str]) -> int | None:
    """The number of leading tokens of ``turn_ids`` after which a stop string first completes, or None.

    Args:
        tokenizer: Decodes token ids (``skip_special_tokens=False``, as the engines do).
        turn_ids: The turn's sampled tokens so far (from the turn's start: earlier turns and results excluded).
        n_checked: Leading tokens already checked for stop strings (the earlier requests of this turn, each of which
            ended without one); only ends after them are looked for.
        stops: The stop strings.
    """
    stops = [s for s in stops if s]
    if not stops or len(turn_ids) <= n_checked:
        return None
    ids = list(turn_ids)
    if not any(s in tokenizer.decode(ids, skip_special_tokens=False) for s in stops):
        return None
    width = max(len(s.encode()) for s in stops) + 1  # every token is >= 1 byte: this tail window covers any stop
    for j in range(n_checked + 1, len(ids) + 1):
        tail = tokenizer.decode(ids[max(0, j - width) : j], skip_special_tokens=False)
        if any(s in tail for s in stops):
            return j
    return None
