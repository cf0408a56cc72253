"""The requests of one :meth:`HFEngine.generate` call, which may grow while it decodes (``on_finish``).

A caller that passes ``on_finish`` hears of every request as soon as it finishes and may answer with new requests;
they join the same call (appended after the others, validated like them) and take free batch slots as rows leave,
so the batch stays full while the caller keeps working. Both decode paths (dynamic and static) hand every result to
:meth:`CallQueue.finish` and take the joined requests from :meth:`CallQueue.take_joined` before they refill.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from arpo_algo.rollout.engines.base import FinishCallback, Generation, GenRequest, error_generation


class CallQueue:
    """The requests, results and pending indices of one call.

    Args:
        requests: The call's requests (copied: joined requests are appended to this list).
        problem: ``problem(req)``: why the engine cannot serve ``req`` (None when it can).
        stats: The engine's counters (``errors`` counts refused requests).
        on_finish: ``on_finish(index, generation)`` for every finished request (``index`` into :attr:`requests`);
            it may return new requests to join the call.
    """

    def __init__(
        self,
        requests: list[GenRequest],
        problem: Callable[[GenRequest], str | None],
        stats: Any,
        on_finish: FinishCallback | None = None,
    ) -> None:
        self.requests: list[GenRequest] = []
        self.results: list[Generation | None] = []
        self.pending: collections.deque[int] = collections.deque()
        self.problem, self.stats, self.on_finish = problem, stats, on_finish
        self._joined: list[int] = []
        #: Seconds spent inside ``on_finish`` (the caller's work, not the engine's).
        self.caller_seconds = 0.0
        self._refused: collections.deque[int] = collections.deque()
        self._add(requests)

    def _add(self, requests: list[GenRequest]) -> None:
        for req in requests:
            i = len(self.requests)
            self.requests.append(req)
            self.results.append(None)
            if self.problem(req):
                self._refused.append(i)
            else:
                self.pending.append(i)
                self._joined.append(i)

    def refuse_invalid(self) -> None:
        """Finish the refused requests (``finish_reason="error"``); their ``on_finish`` may add more."""
        while self._refused:
            i = self._refused.popleft()
            req = self.requests[i]
            self.stats["errors"] += 1
            self.finish(i, error_generation(req, str(self.problem(req))))

    def finish(self, i: int, gen: Generation) -> None:
        """Record request ``i``'s result and tell the caller, whose new requests join the call."""
        self.results[i] = gen
        if self.on_finish is not None:
            t = time.perf_counter()
            more = self.on_finish(i, gen)
            self.caller_seconds += time.perf_counter() - t
            if more:
                self._add(list(more))
                self.refuse_invalid()

    def take_joined(self) -> list[int]:
        """The indices of the requests added since the last call (the first time: the call's own), still pending or
        already finished; the decode loops plan shared prefills from them before they refill."""
        out, self._joined = self._joined, []
        return out

    def plan_joined(
        self,
        twins: collections.Counter,
        runs: dict,
        key: Callable[[GenRequest], Any],
        planner: Callable[[list[GenRequest]], dict],
        fits: Callable[[GenRequest], bool] | None = None,
    ) -> tuple[list[GenRequest], list[int]]:
        """Plan the requests added since the last look into the running decode: count their contexts (``key``) among
        the identical ones (``twins``) and add the leading runs ``planner`` finds among them to ``runs`` (a context
        already planned keeps its run). Those ``fits`` refuses leave the pending queue. Returns the planned requests
        and the indices of the refused ones."""
        fit, later = [], []
        for i in self.take_joined():
            if fits is None or fits(self.requests[i]):
                fit.append(self.requests[i])
            else:
                self.pending.remove(i)
                later.append(i)
        if fit:
            twins.update(key(r) for r in fit)
            for ctx, run in planner(fit).items():
                runs.setdefault(ctx, run)
        return fit, later
