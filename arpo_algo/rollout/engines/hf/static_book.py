"""The host side of the static decode loop (:mod:`arpo_algo.rollout.engines.hf.static_decode`): a step's packed
results, kept in arrays until a row that may have ended is looked at."""

from __future__ import annotations

from typing import Any

import numpy as np


def unpack(out: list[float], k: int, topk: int) -> tuple[int, float, float, list | None]:
    """One token's packed result ``[token, logprob, entropy, top values (k), top ids (k)]`` as the engine records
    it: ``(token, logprob, entropy, top logprobs)``, with ``topk`` of the ``k`` top entries."""
    tok, lp = int(out[0]), out[1]
    top = None
    if topk:
        n = min(topk, k)
        ids = [int(i) for i in out[3 + k : 3 + k + n]]
        top = list(zip(ids, out[3 : 3 + n]))
        if tok not in ids:  # like vLLM: the sampled token is added when it is not in the top k
            top.append((tok, lp))
    return tok, lp, out[2], top


class Book:
    """The host side of one ``decode_all``: every slot's packed results so far, kept in arrays a step at a time.

    The per-row Python of a step (lists, stop strings, finishing) runs only for the rows :meth:`add` says may be done;
    the others' tokens wait here and reach their row's lists (:meth:`keep`) when it is looked at, with the very same
    float64 values a per-token record would have appended.

    Args:
        slots: Decode slots.
        cap: Tokens a row may hold at most, plus one.
        width: Columns of a packed result.
        ends: ``bool[vocab]``, the EOS ids.
        stops: ``bool[vocab]``, the tokens after which a row with stop strings needs its stop check
            (:class:`~arpo_algo.rollout.engines.stop_filter.StopFilter`).
    """

    def __init__(self, slots: int, cap: int, width: int, ends: np.ndarray, stops: np.ndarray) -> None:
        self.out = np.empty((slots, cap, width))  # slot b's i-th token's packed result
        self.count = np.zeros(slots, dtype=np.int64)  # tokens the slot's row holds (kept or not)
        self.kept = np.zeros(slots, dtype=np.int64)  # of those, tokens already in the row's lists
        self.fed = np.zeros(slots, dtype=np.int64)  # tokens whose KV is cached (the row's ``fed``)
        self.limit = np.zeros(slots, dtype=np.int64)  # the row's ``max_new``
        self.has_stops = np.zeros(slots, dtype=bool)
        self.live = np.zeros(slots, dtype=bool)
        self.ends, self.stops = ends, stops

    def start(self, b: int, row: Any) -> None:
        """Slot ``b`` now decodes ``row`` (its first token already recorded in its lists)."""
        self.count[b] = self.kept[b] = len(row.new)
        self.fed[b], self.limit[b] = row.fed, row.max_new
        self.has_stops[b] = bool(row.req.params.stop)
        self.live[b] = True

    def add(self, live: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store one step's results of the ``live`` slots; their tokens and which of them may end their row: EOS,
        the budget reached, or a token that can complete a stop string. No other row can end at this step."""
        got = out[live]
        n = self.count[live]
        self.out[live, n] = got
        n += 1
        self.count[live] = n
        self.fed[live] += 1
        toks = got[:, 0].astype(np.int64)
        look = self.ends[toks] | (n >= self.limit[live]) | (self.has_stops[live] & self.stops[toks])
        return toks, look

    def keep(self, eng: Any, r: Any, b: int, k: int) -> None:
        """Bring row ``r`` (slot ``b``) up to date: its waiting tokens into its lists, its ``fed``."""
        lo, hi = int(self.kept[b]), int(self.count[b])
        block = self.out[b, lo:hi]
        if r.topk:
            for out in block.tolist():
                eng._append(r, *unpack(out, k, r.topk))
        else:  # no top logprobs, so the entropy is the packed one ("full")
            r.new.extend(block[:, 0].astype(np.int64).tolist())
            r.logprobs.extend(block[:, 1].tolist())
            r.entropies.extend(block[:, 2].tolist())
        self.kept[b] = hi
        r.fed = int(self.fed[b])
