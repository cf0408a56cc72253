"""A batching front over one rollout engine, shared by every request of a replica.

Each HTTP request runs its own agent loop (:func:`arpo_algo.rollout.agent_loop.run_agents`) in its own thread, and
that loop calls ``engine.generate`` once per round. Here those calls meet: a single background thread owns the real
engine and, whenever it is free, takes *every* call waiting at that moment and runs them as ONE
``engine.generate``. What joins when, honestly:

* A request that arrives while the engine is idle starts at once (a round of its own).
* A request (or the next turn of a running request, after its tool result) that arrives while a round decodes
  waits for that round to end and then joins the next one, together with everything else that queued meanwhile.
  It does not join a round mid-decode: ``engine.generate`` takes its batch up front. Inside one round the engine
  does refill finished rows from that round's list (HFEngine), so short and long requests of a round do not wait
  for each other's rows, only for the round.
* Prefix reuse across the turns of one request comes from the engine's KV store (``prefix_key``), which every
  round shares; identical contexts in a round (``n > 1``) are prefilled once.

Work that must run between rounds (:meth:`BatchingEngine.between_rounds`: an agent's adapter added or removed) does
not wait for a long round either: on a streaming engine it aborts the round, runs, and the round is replayed as below.

A cancelled request (client gone) stops at once, mid-round too: its next streamed token aborts the round (an
exception out of ``on_token``), its calls are answered with error generations (its conversation ends), and the
other calls of that round are run again at once. The replay gives them the same tokens, because every request
carries an explicit seed (one is drawn here for unseeded ones) and the engine samples each request from its own
seeded generator; tokens already streamed are not streamed twice. The price is the aborted round's compute.
An engine that cannot stream (``streams_tokens = False``: the vLLM engine, which hands over each request's tokens
only once its ``generate`` call has finished) cannot be stopped mid-round: its round runs to the end, the
cancelled request's tokens are dropped, and nothing is re-run (the round is already paid for).
"""

from __future__ import annotations

import collections
import dataclasses
import random
import threading
import time
from typing import Any

from arpo_algo.rollout.engines.base import Generation, GenRequest, error_generation

CANCELLED = "cancelled: the client disconnected"


class EngineDead(RuntimeError):
    """The front's thread or its engine is gone: no call is answered any more (the replica must be replaced)."""


class _Abort(Exception):
    """Raised out of ``on_token`` to stop a round that holds a cancelled request."""


@dataclasses.dataclass(eq=False)
class _Call:
    requests: list[GenRequest]
    on_token: Any
    cancel: threading.Event | None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    results: list[Generation] | None = None
    error: BaseException | None = None


class BatchingEngine:
    """Thread-safe front: :meth:`view` gives each request an engine-shaped handle; all of them share rounds.

    Args:
        engine: The real engine (``RolloutEngine``). Only this front's thread calls its ``generate``/``release``.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_context = getattr(engine, "max_context", None) or getattr(engine, "max_positions", None)
        self.streams = bool(getattr(engine, "streams_tokens", True))  # False: tokens come after the round
        self._cv = threading.Condition()
        self._calls: collections.deque[_Call] = collections.deque()
        self._releases: list[Any] = []
        self._between: list[tuple[Any, dict[str, Any], threading.Event]] = []
        self._closed = False
        self._stats: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._loop, name="arpo-serve-batcher", daemon=True)
        self._thread.start()

    def view(self, cancel: threading.Event | None = None, adapter: str | None = None) -> EngineView:
        """An engine-shaped handle for one request; ``cancel`` set = the client is gone; ``adapter``: every call
        of it runs under that adapter of the engine (agents sharing one base)."""
        return EngineView(self, cancel, adapter)

    def between_rounds(self, fn: Any) -> Any:
        """Run ``fn()`` in the engine's thread between two rounds (no round is decoding then: the engine's model
        may change, e.g. an adapter added) and return its result; its exception is raised here."""
        box: dict[str, Any] = {}
        done = threading.Event()
        with self._cv:
            if self._closed:
                raise EngineDead("the batching engine is closed")
            self._between.append((fn, box, done))
            self._cv.notify()
        while not done.wait(0.5):
            if not self._thread.is_alive():
                raise EngineDead("the batching thread stopped")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def submit(
        self, requests: list[GenRequest], on_token: Any = None, cancel: threading.Event | None = None
    ) -> list[Generation]:
        """Queue ``requests`` for the next round and wait for their results (request ids are kept)."""
        call = _Call(list(requests), on_token, cancel)
        if not call.requests:
            return []
        with self._cv:
            if self._closed:
                raise EngineDead("the batching engine is closed")
            self._calls.append(call)
            self._cv.notify()
        while not call.done.wait(0.5):  # a caller never waits on a thread that died: it would wait forever
            if not self._thread.is_alive():
                raise EngineDead("the batching thread stopped")
        if call.error is not None:
            raise call.error
        return call.results  # type: ignore[return-value]

    def release(self, cache_keys: list[Any]) -> None:
        with self._cv:
            self._releases.extend(cache_keys)

    def stats(self) -> dict[str, float]:
        """Front counters since start: rounds, requests, mean requests per round, seconds in the engine."""
        with self._cv:
            s = {k: float(v) for k, v in self._stats.items()}
        s["mean_round_size"] = s.get("requests", 0.0) / max(s.get("rounds", 0.0), 1.0)
        return s

    def alive(self) -> bool:
        """Whether calls are still answered: the front is open, its thread runs and the engine says it is alive
        (an engine without ``alive()``, the in-process HF engine, lives in this thread)."""
        if self._closed or not self._thread.is_alive():
            return False
        probe = getattr(self.engine, "alive", None)
        return bool(probe()) if callable(probe) else True

    def close(self) -> None:
        """Stop: the running round is aborted (on a streaming engine), every waiting call fails with
        :class:`EngineDead`, then the engine is closed."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()

    # ------------------------------------------------------------------------------------------------ the loop
    def _run_between(self) -> None:
        with self._cv:
            jobs, self._between = self._between, []
        for fn, box, done in jobs:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller of between_rounds
                box["error"] = e
            done.set()

    def _take(self) -> tuple[list[_Call], list[Any]] | None:
        with self._cv:
            while not self._calls and not self._closed and not self._between:
                self._cv.wait()
            if self._between and not self._closed:
                return [], []
            if self._closed:
                for call in self._calls:
                    call.error = EngineDead("the batching engine is closed")
                    call.done.set()
                self._calls.clear()
                return None
            calls, self._calls = list(self._calls), collections.deque()
            releases, self._releases = self._releases, []
            return calls, releases

    def _loop(self) -> None:
        while (taken := self._take()) is not None:
            self._run_between()
            calls, releases = taken
            if releases:
                self.engine.release(releases)
            live = self._drop_cancelled(calls)
            if live:
                self._round(live)

    @staticmethod
    def _drop_cancelled(calls: list[_Call]) -> list[_Call]:
        live = []
        for call in calls:
            if call.cancel is not None and call.cancel.is_set():
                call.results = [error_generation(r, CANCELLED) for r in call.requests]
                call.done.set()
            else:
                live.append(call)
        return live

    def _round(self, live: list[_Call]) -> None:
        for c in live:  # explicit seeds: a replayed round must sample the same tokens
            c.requests = [
                r
                if r.params.seed is not None
                else dataclasses.replace(r, params=dataclasses.replace(r.params, seed=random.getrandbits(63)))
                for r in c.requests
            ]
        streamed: dict[tuple[int, int], int] = {}  # (call, request) -> tokens already handed to its on_token
        t0 = time.perf_counter()
        while live:
            flat = [
                dataclasses.replace(r, request_id=(ci, j))
                for ci, c in enumerate(live)
                for j, r in enumerate(c.requests)
            ]
            seen: dict[tuple[int, int], int] = {}

            def on_token(rid: Any, token: int, live: list[_Call] = live, seen: dict = seen) -> None:
                if (self._closed or self._between) and self.streams:
                    raise _Abort
                c = live[rid[0]]
                if c.cancel is not None and c.cancel.is_set():
                    if self.streams:
                        raise _Abort
                    return  # the round is over already: aborting it would only re-run the others
                key = (id(c), rid[1])
                seen[key] = seen.get(key, 0) + 1
                if seen[key] > streamed.get(key, 0):
                    streamed[key] = seen[key]
                    if c.on_token is not None:
                        c.on_token(c.requests[rid[1]].request_id, token)

            try:
                gens = self.engine.generate(flat, on_token=on_token)
            except _Abort:
                if self._closed:
                    for c in live:
                        c.error = EngineDead("the batching engine is closed")
                        c.done.set()
                    return
                with self._cv:
                    self._stats["aborted_rounds"] += 1
                self._run_between()  # e.g. an adapter added: then the round is replayed, same seeds, same tokens
                live = self._drop_cancelled(live)
                continue
            except BaseException as e:  # noqa: BLE001 - handed to every waiting caller; the loop keeps serving
                for c in live:
                    c.error = e
                    c.done.set()
                return
            self._deliver(live, gens, len(flat), time.perf_counter() - t0)
            return

    def _deliver(self, live: list[_Call], gens: list[Generation], n: int, seconds: float) -> None:
        for c in live:
            c.results = [None] * len(c.requests)  # type: ignore[list-item]
        for g in gens:
            ci, j = g.request_id
            g.request_id = live[ci].requests[j].request_id
            live[ci].results[j] = g  # type: ignore[index]
        with self._cv:
            self._stats["rounds"] += 1
            self._stats["requests"] += n
            self._stats["calls"] += len(live)
            self._stats["engine_seconds"] += seconds
        for c in live:
            c.done.set()


class EngineView:
    """What one request's agent loop sees: the ``RolloutEngine`` interface, routed through the shared front."""

    def __init__(self, front: BatchingEngine, cancel: threading.Event | None, adapter: str | None = None) -> None:
        self.front, self.cancel, self.adapter = front, cancel, adapter
        self.tokenizer = front.tokenizer
        self.max_context = front.max_context
        self.max_positions = front.max_context

    def generate(self, requests: list[GenRequest], *, on_token: Any = None) -> list[Generation]:
        if self.adapter is not None:
            requests = [dataclasses.replace(r, adapter=self.adapter) for r in requests]
        return self.front.submit(requests, on_token, self.cancel)

    def release(self, cache_keys: list[Any]) -> None:
        self.front.release(list(cache_keys))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("a served agent's weights are fixed; redeploy to change them")

    def stats(self) -> dict[str, float]:
        return self.front.stats()

    def close(self) -> None:
        """Nothing to free per request (the front owns the engine)."""
