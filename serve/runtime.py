"""One served agent inside a replica: its engine (behind the batching front), its tools, and one request's run.

A request becomes token ids by THE layout rule of training (:mod:`arpo_algo.rollout.layout`): the chat template of
the messages (the agent's system prompt added when the request has none) with the generation prompt. Its ``n``
choices are ``n`` conversations of :func:`arpo_algo.rollout.agent_loop.run_agents`, the loop training uses, over
``arpo_env.session.ToolSession`` (the same tools, sandbox and result format as training); the tool results are
appended token for token as in training.

Seeds: a request with ``seed = s`` samples request ``k`` of choice ``j`` with ``derive_seed(s, 0, 0, j, k)``: exactly
the seeds the GRPO-mode ``TreeSampler(seed=s)`` gives trajectory ``j`` of task index 0 at step 0, so the same
prompt, seed and checkpoint give the training trajectory (tests/serve/test_serve.py checks it). Its persistent
interpreters start from the seed that trajectory's do (``tools_seed(s, 0, 0, j)``), so their ``random`` and numpy draws
agree too. Without a seed they start from the OS.

Client-side tools (``tools`` in the request, or ``arpo.tool_mode = "client"``): a turn that ends in a tool call is
returned as OpenAI ``tool_calls`` (finish_reason ``tool_calls``) instead of being run. The client sends the
assistant message back as it got it (its ``content`` is the model's text, call included) followed by
``role: tool`` messages; those are appended as the model's text and the formatted tool result (the assistant text
is re-tokenized here: a stateless API has nothing else to go on).
"""

from __future__ import annotations

import functools
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from arpo_algo.core.tree import derive_seed, tools_seed
from arpo_algo.rollout.engines.base import SamplingParams
from arpo_algo.rollout.layout import observation_ids, prompt_ids, text_ids
from arpo_base.errors import ConfigError
from arpo_env.session import SessionStep, ToolSession
from arpo_env.tools.interpreter import InterpretersExhausted
from arpo_env.tools.sandbox import cancel_scope
from serve.agents import AgentSpec
from serve.batching import BatchingEngine
from serve.openai_api import check_tools, logprob_entries, logprob_problem, tool_items
from serve.schema import MAX_REQUEST_TOOL_CALLS, APIError, ChatRequest

#: Agent finish reasons -> OpenAI ones.
FINISH = {"length": "length", "client_tool": "tool_calls"}


def choice_seed(seed: int, choice: int, k: int) -> int:
    """The seed of request ``k`` of choice ``choice`` (= TreeSampler's for trajectory ``choice``, task 0, step 0)."""
    return derive_seed(seed, 0, 0, choice, k)


@dataclass
class Job:
    """A validated request turned into token ids and loop settings."""

    prompt: list[int]
    n: int
    max_response_tokens: int
    sampling: SamplingParams
    seed: int | None
    stop: list[str]
    client_tools: bool
    prior_tool_calls: int
    include_usage: bool
    max_tool_calls: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    turn: Any = None  # the episode turn this request records (serve.record.Turn), or None


class EngineFailure(RuntimeError):
    """A conversation of the request ended in an engine error (a request the engine rejected, a failed round) or in
    a failed sandbox: a server fault, never a completion with ``finish_reason`` "stop"."""


def run_failure(sessions: list[ServeSession], failed: list[str]) -> Exception:
    """What a request whose conversations ended in ``failed`` errors raises: a 503 (``interpreters_exhausted``, with
    Retry-After) when a tool call found no persistent interpreter free, a transient state and never a 500; else
    :class:`EngineFailure`, a server fault."""
    if any(s.exhausted for s in sessions):
        return APIError(
            "the server's Python interpreters are all in use (or this request holds its share of them); retry "
            "shortly, or ask for fewer choices (n)",
            status=503,
            type="server_error",
            code="interpreters_exhausted",
        )
    return EngineFailure(failed[0] or "engine error (no message)")


class ServeSession:
    """A ``ToolSession`` plus what a request adds: the client's ``stop`` strings, client-side tool calls and the
    request's ``cancel`` event, under which its tool calls run (set: the sandboxed process is killed at once)."""

    def __init__(
        self, inner: ToolSession, stop: list[str], client_tools: bool, cancel: threading.Event | None = None
    ) -> None:
        self.inner, self.user_stop, self.client_tools, self.cancel = inner, list(stop), client_tools, cancel
        self.client_call: tuple[str, dict] | None = None
        self.exhausted = False  # a tool call found no persistent interpreter free: the request answers 503

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return tuple(self.inner.stop_sequences) + tuple(s for s in self.user_stop if s not in self.inner.stop_sequences)

    def step(self, action: str) -> SessionStep:
        if any(s in action for s in self.user_stop):
            return SessionStep("", True, "stop", "text")
        if self.client_tools:
            parsed = self.inner.protocol.parse(action)
            if parsed.kind == "tool_call" and self.inner.counts["tool_calls"] < self.inner.config["max_tool_calls"]:
                self.client_call = (parsed.tool, dict(parsed.args))
                return SessionStep("", True, "client_tool", "tool", tool=parsed.tool, args=dict(parsed.args))
        with cancel_scope(self.cancel):  # in the thread that runs the tool, whichever the agent loop uses
            try:
                return self.inner.step(action)
            except InterpretersExhausted:
                self.exhausted = True
                raise


#: The most ids a stream holds back waiting for a UTF-8 character to finish (a character has at most 4 bytes).
MAX_HELD_IDS = 8


class TextStream:
    """Token ids of one choice -> text deltas, holding back what could still become a client stop string.

    ``token`` feeds one sampled token; ``end_segment`` flushes at a tool result (the next turn decodes afresh).
    Deltas go to ``out``; after a stop string nothing more is emitted. The non-streaming content is built with the
    same class, so a stream's deltas always add up to the non-streaming ``content``.

    Incremental: each token costs two ``decode`` calls over a window of the last few ids (the text of the ids before
    the window, as a prefix, is subtracted from the text of the window with the new id), and a stop string is looked
    for only where it could end, so the work per token does not grow with the reply (the batcher thread that runs
    this serves every request).
    """

    def __init__(self, tokenizer: Any, stop: list[str], out: Any) -> None:
        self.tok, self.stop, self.out = tokenizer, stop, out
        self.longest_stop = max((len(s) for s in stop), default=0)
        self.stopped = False
        self._reset()

    def _reset(self) -> None:
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded as the context of the next token's text
        self.read = 0  # ids before this index are in self.text
        self.text = ""
        self.sent = 0

    def token(self, token_id: int) -> None:
        self.ids.append(token_id)
        if self.stopped:
            return
        self._advance(final=False)

    def end_segment(self) -> None:
        if not self.stopped:
            self._advance(final=True)
        self._reset()

    def _advance(self, final: bool) -> None:
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        window = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        waiting = len(self.ids) - self.read
        if not final and waiting < MAX_HELD_IDS and (window.endswith("\ufffd") or len(window) <= len(before)):
            return  # an incomplete UTF-8 character (or no text yet): wait for the next token, but only a few
        # Past MAX_HELD_IDS ids a trailing U+FFFD is no unfinished character (one has at most 4 bytes) but the text of
        # ids that decode to it: taken as it is, so the window, and each decode, stays a few ids long.
        self.text += window[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self._push(final)

    def _push(self, final: bool) -> None:
        text = self.text
        start = max(0, self.sent - self.longest_stop)  # a stop string not found before cannot start earlier
        cut = min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        elif final:
            end = len(text)
        else:  # hold back a tail that is a prefix of a stop string
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            end = len(text) - hold
        if end > self.sent:
            self.out(text[self.sent : end])
            self.sent = end
        if self.sent > 4096 + self.longest_stop:  # what was sent is needed only as far back as a stop string reaches
            drop = self.sent - self.longest_stop
            self.text, self.sent = self.text[drop:], self.sent - drop


class Agent:
    """One agent's engine, batching front and tool session template (built in the replica).

    ``front``/``adapter``: the agent runs on a shared engine (:class:`SharedBase`) under that adapter (None: the
    base itself) instead of an engine of its own; its prompt, tools and limits stay its own."""

    def __init__(self, spec: AgentSpec, front: BatchingEngine | None = None, adapter: str | None = None) -> None:
        self.spec = spec
        self.session = ToolSession(spec.session)
        self.adapter = adapter
        if front is None:
            from arpo_algo.rollout.engines import build_engine

            front = BatchingEngine(build_engine(spec.engine, model_or_path=spec.model_path, **spec.engine_settings))
        self.front = front
        self.tok = front.tokenizer
        self.max_context = self.front.max_context
        #: The function schema of each trained tool: what a request's ``tools`` must match.
        self.trained_tools = {name: tool.schema() for name, tool in self.session.tools.items()}
        self.running = 0  # requests of this agent in flight (a removed agent's adapter is unloaded at 0)
        self._count = threading.Lock()

    # --------------------------------------------------------------------------------------------- request -> job
    def prepare(self, req: ChatRequest, recorder: Any = None, scope: str = "") -> Job:
        """Token ids and settings for ``req``; client mistakes raise :class:`APIError` (400). With a ``recorder``
        and an episode, a history that continues a recorded reply is rendered from its recorded ids
        (:mod:`serve.record`)."""
        limit = self.session.config["max_tool_calls"]
        per_choice = limit if req.max_tool_calls is None else min(limit, req.max_tool_calls)
        if req.n * per_choice > MAX_REQUEST_TOOL_CALLS:
            raise APIError(
                f"n x tool calls per choice may be at most {MAX_REQUEST_TOOL_CALLS} per request, got "
                f"{req.n} x {per_choice}; lower 'n' or 'arpo.max_tool_calls'",
                param="n",
            )
        check_tools(req.tools, self.trained_tools)
        if req.logprobs:
            problem = logprob_problem(self.spec.engine, self.spec.engine_settings, req.temperature)
            if problem:
                raise APIError(f"'logprobs' cannot be served by this agent: {problem}", param="logprobs")
        msgs = req.messages
        if msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": self.session.system_prompt()}, *msgs]
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if not users:
            raise APIError("'messages' must contain a user message", param="messages")
        head, tail = msgs[: users[-1] + 1], msgs[users[-1] + 1 :]
        ids = prompt_ids(self.tok, [{"role": m["role"], "content": m["content"]} for m in head])
        prior = 0
        for m in tail:  # a client-side tool round: the model's text, then the tool result, as in training
            if m["role"] == "assistant":
                ids += text_ids(self.tok, m["content"])
            elif m["role"] == "tool":
                ids += observation_ids(self.tok, self.session.protocol.format_result(m["content"]))
                prior += 1
            else:
                raise APIError(f"a {m['role']} message cannot follow the last user message", param="messages")
        turn = None
        if recorder is not None and req.episode:
            turn, ids = recorder.render(self, req, scope, ids)
            turn.logprob_problem = logprob_problem(self.spec.engine, self.spec.engine_settings, req.temperature)
        ceiling = self.spec.max_tokens_limit
        if req.max_tokens is not None and req.max_tokens > ceiling:
            raise APIError(
                f"'max_tokens' may be at most {ceiling} on this server, got {req.max_tokens}", param="max_tokens"
            )
        ctx = self.max_context
        if ctx is not None and len(ids) >= ctx:
            raise APIError(
                f"This model's maximum context length is {ctx} tokens; the messages take {len(ids)} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        if req.max_tokens is not None and ctx is not None and len(ids) + req.max_tokens > ctx:
            raise APIError(
                f"This model's maximum context length is {ctx} tokens; you requested "
                f"{len(ids) + req.max_tokens} ({len(ids)} in the messages, {req.max_tokens} in the "
                "completion)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        budget = req.max_tokens or self.spec.max_tokens
        if ctx is not None:
            budget = min(budget, ctx - len(ids))
        with self._count:  # until run() ends: a removed agent is freed only once nothing of it runs
            self.running += 1
        return Job(
            prompt=ids,
            n=req.n,
            max_response_tokens=budget,
            sampling=SamplingParams(temperature=req.temperature, top_p=req.top_p, logprobs_topk=req.top_logprobs),
            seed=req.seed,
            stop=req.stop,
            client_tools=req.tool_mode == "client",
            prior_tool_calls=prior,
            include_usage=req.include_usage,
            max_tool_calls=req.max_tool_calls,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            turn=turn,
        )

    # -------------------------------------------------------------------------------------------------- running
    def _sessions(self, job: Job, cancel: threading.Event | None = None) -> list[ServeSession]:
        out = []
        for j in range(job.n):
            s = self.session.clone()
            s.reset()
            if job.seed is not None:  # a seeded choice's interpreters draw what training's trajectory j's would
                s.seed_tools(tools_seed(job.seed, 0, 0, j))
            if job.max_tool_calls is not None:  # a request may lower the agent's limit, never raise it
                s.config["max_tool_calls"] = min(s.config["max_tool_calls"], job.max_tool_calls)
            s.counts["tool_calls"] = job.prior_tool_calls
            out.append(ServeSession(s, job.stop, job.client_tools, cancel))
        return out

    def run(self, job: Job, cancel: threading.Event, emit: Any = None) -> dict[str, Any]:
        """Run the ``n`` conversations; ``emit(kind, index, payload)`` streams deltas and tool events."""
        try:
            return self._run(job, cancel, emit)
        finally:
            with self._count:
                self.running -= 1

    def _run(self, job: Job, cancel: threading.Event, emit: Any = None) -> dict[str, Any]:
        from arpo_algo.rollout.agent_loop import run_agents

        sessions = self._sessions(job, cancel)
        streams = [
            TextStream(self.tok, job.stop, functools.partial(emit, "delta", j) if emit else _drop) for j in range(job.n)
        ]
        lock = threading.Lock()

        def on_token(i: int, token_id: int) -> None:
            with lock:
                streams[i].token(token_id)

        last_tool: dict[int, tuple[str, str]] = {}

        def on_event(i: int, ev: dict[str, Any]) -> None:
            kind = ev.get("type")
            if kind in ("tool_call", "tool_result"):
                with lock:
                    streams[i].end_segment()
                payload = {k: v for k, v in ev.items() if k != "type"}
                if kind == "tool_call":  # the call's id joins its result (Responses items in the stream)
                    last_tool[i] = (str(payload.get("tool")), f"call_{uuid.uuid4().hex[:20]}")
                tool, call_id = last_tool.get(i, (None, ""))
                payload.setdefault("tool", tool)
                payload["call_id"] = call_id
                emit(kind, i, _jsonable(payload))

        seeds = None if job.seed is None else [functools.partial(choice_seed, job.seed, j) for j in range(job.n)]
        view: Any = self.front.view(cancel, self.adapter)
        recording = job.turn is not None and not job.turn.refused
        if job.logprobs or (recording and not job.turn.logprob_problem):  # a recorded turn keeps its log-probs
            view = LogprobRecorder(view, job.n, job.top_logprobs, emit if job.logprobs else None, job.logprobs)
        try:
            traces = run_agents(
                view,
                sessions,
                [list(job.prompt)] * job.n,
                job.sampling,
                max_response_tokens=job.max_response_tokens,
                seeds=seeds,
                on_event=on_event if emit else None,
                on_token=on_token if emit else None,
            )
        finally:  # one persistent interpreter per choice, ended with the request (finished, failed or cancelled)
            for s in sessions:
                s.inner.close()
        failed = [t.error for t in traces if t.finish_reason == "error"]
        if failed and not cancel.is_set():  # a cancelled request's answer is already sent
            raise run_failure(sessions, failed)
        choices = []
        for j, (trace, sess) in enumerate(zip(traces, sessions)):
            if emit:
                with lock:
                    streams[j].end_segment()
            choice = self._choice(j, trace, sess, job)
            if job.logprobs:
                choice["logprobs"] = {"content": view.entries[j], "refusal": None}
            choices.append(choice)
        if job.turn is not None:
            values = view.values if isinstance(view, LogprobRecorder) else None
            job.turn.recorder.finish(self.spec, job, traces, choices, values)
        for j, choice in enumerate(choices):
            if emit:
                emit("done", j, choice)
        completion = sum(len(t.response_ids) for t in traces)
        return {
            "choices": choices,
            "usage": {
                "prompt_tokens": len(job.prompt) * job.n,
                "completion_tokens": completion,
                "total_tokens": len(job.prompt) * job.n + completion,
            },
        }

    def _content(self, trace: Any, job: Job) -> str:
        """The model's own text (tool results left out), cut at a client stop string: what the stream sent."""
        parts: list[str] = []
        ts = TextStream(self.tok, job.stop, parts.append)
        prev = 1
        for tid, m in zip(trace.response_ids, trace.trained_mask):
            if m == 0 and prev == 1:
                ts.end_segment()
            if m == 1:
                ts.token(tid)
            prev = m
        ts.end_segment()
        return "".join(parts)

    def _choice(self, j: int, trace: Any, sess: ServeSession, job: Job) -> dict[str, Any]:
        calls = [_jsonable(c) for c in trace.tool_calls]
        finish = "client_tool" if sess.client_call else trace.finish_reason
        ext: dict[str, Any] = {
            "finish_reason": finish,
            "tool_calls": calls,
            "trajectory": self.tok.decode(trace.response_ids, skip_special_tokens=True),
            "response_ids": list(trace.response_ids),
            "trained_mask": list(trace.trained_mask),
        }
        message: dict[str, Any] = {"role": "assistant", "content": self._content(trace, job), "arpo": ext}
        if sess.client_call:
            tool, args = sess.client_call
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:20]}",
                    "type": "function",
                    "function": {"name": tool, "arguments": json.dumps(args)},
                }
            ]
        items = []
        for call in calls:
            items += tool_items(call, f"call_{uuid.uuid4().hex[:20]}")
        return {
            "index": j,
            "message": message,
            "finish_reason": FINISH.get(finish, "stop"),
            "logprobs": None,
            "output": items,
        }


class LogprobRecorder:
    """An engine view that keeps, per conversation and in order, the OpenAI ``logprobs`` entries of every token the
    engine sampled (trained mask 1; tool results and an appended tool-limit EOS are not sampled), and streams each
    generation's entries as it returns (``emit("logprobs", i, entries)``): a stream's entries add up to the
    non-streaming ones."""

    def __init__(self, view: Any, n: int, top: int, emit: Any = None, entries: bool = True) -> None:
        self.view, self.top, self.emit, self.with_entries = view, top, emit, entries
        self.tokenizer = view.tokenizer
        self.max_context = view.max_context
        self.entries: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self.values: list[list[float]] = [[] for _ in range(n)]  # the sampled tokens' log-probs, for the record

    def generate(self, requests: list[Any], *, on_token: Any = None) -> list[Any]:
        gens = self.view.generate(requests, on_token=on_token)
        for gen in gens:
            i = gen.request_id[0]  # the agent loop's ids: (conversation, request number)
            self.values[i] += gen.logprobs
            if not self.with_entries:
                continue
            new = logprob_entries(self.tokenizer, gen, self.top)
            self.entries[i] += new
            if self.emit is not None and new:
                self.emit("logprobs", i, new)
        return gens

    def release(self, cache_keys: list[Any]) -> None:
        self.view.release(cache_keys)


class SharedBase:
    """One engine over the base model the adapter agents of a replica were trained on, behind one batching front:
    every adapter agent is a named adapter in it, so requests of different agents decode in the same batches (HF:
    PEFT's per-row adapters; vLLM: one LoRA request per agent).

    vLLM fixes its LoRA capacity when it starts: ``max_loras`` = the adapter agents given (``adapters``, at least 1)
    and ``max_lora_rank`` = the smallest value vLLM accepts that holds their largest rank. An agent added later with
    a larger rank is refused by name; more agents than ``max_loras`` are served, fewer of them per batch.

    Invariant: the adapter names inside the engine are this object's own (``adapter_<n>``, never reused), so an
    agent removed and added again under its old name never meets the removed one's adapter or stored KV."""

    def __init__(
        self,
        base: str,
        fingerprint: str,
        engine_settings: dict[str, Any],
        engine: str = "hf",
        adapters: list[AgentSpec] | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        from arpo_algo.rollout.engines import engine_spec

        spec = engine_spec(engine)
        sizing: dict[str, int] = {}
        if isinstance(spec.capabilities.lora_ranks, tuple):  # built for a fixed adapter count and largest rank
            from arpo_algo.models.lora import adapter_settings

            ranks = [adapter_settings(s.model_path)[0].rank for s in adapters or []]
            sizing = {"max_loras": max(1, len(ranks)), "max_lora_rank": max(ranks or [1])}
        self.engine: Any = spec.engine_class()(base, adapters={}, **sizing, **engine_settings)
        if self.engine.base_fingerprint != fingerprint:
            raise ConfigError(
                f"the base model at {base} changed since the agents were resolved (weights "
                f"fingerprint {self.engine.base_fingerprint[:12]}..., expected {fingerprint[:12]}...)",
                hint="restore the base the adapters were trained on",
            )
        self.front = BatchingEngine(self.engine)
        self._next = 0

    def add(self, spec: AgentSpec) -> Agent:
        """An agent for ``spec`` on this base: its adapter loaded between rounds (a full-weight agent whose weights
        are the base itself runs on the base, adapter-free)."""
        if not spec.base:
            return Agent(spec, self.front, None)
        _same_tokenizer(spec, self.front.tokenizer)
        name = f"adapter_{self._next}"
        self._next += 1
        self.front.between_rounds(lambda: self.engine.add_adapter(name, spec.model_path))
        return Agent(spec, self.front, name)

    def remove(self, agent: Agent) -> None:
        """Unload ``agent``'s adapter between rounds (its requests must have finished)."""
        if agent.adapter is not None:
            self.front.between_rounds(lambda: self.engine.remove_adapter(agent.adapter))


def _same_tokenizer(spec: AgentSpec, tok: Any) -> None:
    """An adapter agent's tokenizer must be its base's (the engine decodes with the base's)."""
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(spec.model_path)
    if own.get_vocab() != tok.get_vocab():
        raise ConfigError(
            f"agent {spec.name!r}: its tokenizer differs from its base model's",
            hint="an adapter must keep its base's vocabulary; merge it (arpo export --merge) and "
            "serve the merged folder as a full-weight agent",
        )


def _drop(_text: str) -> None:
    """Delta sink of a non-streaming request."""


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))
