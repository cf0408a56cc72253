"""The rollout-engine interface: token ids in, token ids (with logprobs and entropies) out.

An engine continues a batch of token sequences. It never sees text except the stop strings, so the caller owns
tokenization: a tool result is tokenized once as its own segment and appended, and nothing earlier is ever
re-tokenized (docs/concepts/arpo.md#token-layout). Engines: :class:`arpo_algo.rollout.engines.hf.engine.HFEngine`
(transformers, CPU or GPU) and
:class:`arpo_algo.rollout.engines.vllm.engine.VLLMEngine` (vLLM 0.29, CPU or GPU);
either one replicated over Ray actors by
:class:`arpo_algo.rollout.engines.actors.RolloutActorPool`. Build any of them with
:func:`arpo_algo.rollout.engines.build_engine`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast, runtime_checkable

FinishReason = Literal["stop", "eos", "length", "error"]

#: Running counters of an engine or a sampler: counts and summed seconds by name, a key never written reading 0.
Tally = dict[str, float]


def new_tally() -> Tally:
    """An empty :data:`Tally`: a ``collections.Counter``, typed as a dict because typeshed fixes a Counter's values to
    int and these also sum seconds."""
    return cast(Tally, collections.Counter())


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    Attributes:
        max_new_tokens: Generate at most this many tokens for this request (per request, not per batch:
            docs/concepts/arpo.md#per-request-budget).
        temperature: Softmax temperature; 0 means greedy.
        top_p: Nucleus sampling mass (1.0 = off).
        top_k: Keep the k most likely tokens (-1 = off).
        stop: Stop strings. Generation ends right after the token that completes one; that token is kept.
        seed: Seed of this request's private random generator; the same seed and context give the same tokens.
        logprobs_topk: Also return this many top logprobs per token (needed by the reference entropy estimator).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs_topk: int = 0


@dataclass
class GenRequest:
    """One sequence to continue.

    Attributes:
        request_id: Caller's id, echoed in the result and in error messages.
        token_ids: The whole context so far (prompt + everything appended), as token ids.
        params: Sampling settings.
        prefix_key: Optional hint: the ``cache_key`` of an earlier :class:`Generation` whose context is a prefix of
            ``token_ids``. The engine may reuse that sequence's KV cache and only prefill the new suffix. The result
            must be identical with or without the hint (the engine verifies the tokens).
        adapter: The name of one of the engine's loaded LoRA adapters to continue under (an engine serving several
            agents on one base); None: the engine's model as loaded. An engine without that adapter answers an error.
    """

    request_id: Any
    token_ids: list[int]
    params: SamplingParams
    prefix_key: Any = None
    adapter: str | None = None


@dataclass
class Generation:
    """The engine's answer for one request.

    Attributes:
        request_id: The request's id.
        token_ids: The newly generated tokens only (stop-string tokens included, EOS included when hit).
        logprobs: log pi(token) under the sampling distribution's base model (raw logits, temperature applied),
            one per new token.
        entropies: Per-token entropy (nats) of the full distribution the token was drawn from, one per new token.
        finish_reason: "stop" (a stop string), "eos", "length" (max_new_tokens) or "error".
        stop_string: The stop string that ended generation, if any.
        top_logprobs: Per token, the top-k (token_id, logprob) pairs, when ``logprobs_topk`` > 0.
        cache_key: A handle the caller may pass back as ``prefix_key`` to reuse this sequence's KV cache.
        error: Error text when finish_reason == "error".
    """

    request_id: Any
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish_reason: FinishReason
    stop_string: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cache_key: Any = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def request_problem(
    req: GenRequest, *, max_context: int | None, vocab_size: int, max_logprobs: int, adapters: Any = ()
) -> str | None:
    """Why an engine cannot serve ``req`` (None when it can): the same checks and messages in every engine.

    Args:
        req: The request.
        max_context: Longest context the engine accepts, in tokens (None = unbounded).
        vocab_size: Token ids must lie in ``[0, vocab_size)``.
        max_logprobs: Most top logprobs per token the engine returns (its ``max_logprobs``); a request for more is
            refused rather than served with fewer, which would change its top-k entropy estimate.
        adapters: The names of the adapters the engine holds (a request naming another one is refused, never served
            by the base or by another adapter).
    """
    if req.adapter is not None and req.adapter not in adapters:
        return f"adapter {req.adapter!r} is not loaded in this engine"
    n = len(req.token_ids)
    if n == 0:
        return "empty context (token_ids is empty)"
    if max_context is not None and n > max_context:
        return f"context of {n} tokens exceeds the model's maximum of {max_context} tokens"
    if min(req.token_ids) < 0 or max(req.token_ids) >= vocab_size:
        return f"token id out of range [0, {vocab_size})"
    p = req.params
    if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k == 0 or p.logprobs_topk < 0:
        return f"invalid sampling params {p}"
    if p.logprobs_topk > max_logprobs:
        return f"logprobs_topk={p.logprobs_topk} exceeds this engine's maximum of {max_logprobs} top logprobs per token"
    return None


def error_generation(req: GenRequest, problem: str) -> Generation:
    """The result for a request the engine cannot serve: ``finish_reason="error"``, naming the request id."""
    return Generation(req.request_id, [], [], [], "error", error=f"request {req.request_id!r}: {problem}")


#: ``on_token(request_id, token_id)``: called for each sampled token as it is produced (see RolloutEngine.generate).
TokenCallback = Callable[[Any, int], None]


#: ``on_finish(index, generation)``: called as each request of a call finishes (``index`` into the call's requests,
#: joined ones after the first); new requests it returns join the same call. Only engines whose ``joins_requests``
#: is True take it (the HF engine); the tree sampler falls back to one call per round on the others.
FinishCallback = Callable[[int, Generation], list[GenRequest] | None]


def replay_tokens(on_token: TokenCallback | None, results: list[Generation]) -> None:
    """For engines that cannot stream: call ``on_token`` for every token of every finished request, in order."""
    if on_token is None:
        return
    for gen in results:
        for tok in gen.token_ids:
            on_token(gen.request_id, tok)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the tree sampler, the agent loop, eval and serve need from an engine.

    Attributes:
        tokenizer: The engine's tokenizer (the caller tokenizes; the engine never sees text except stop strings).
        max_context: Longest prompt plus generation the engine accepts, in tokens (None = unbounded).
    """

    # read-only for callers: an engine may keep them as plain attributes or as properties (the actor pool fetches them)
    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_context(self) -> int | None: ...

    def generate(self, requests: list[GenRequest], *, on_token: TokenCallback | None = None) -> list[Generation]:
        """Continue every request; results in request order. Never raises for one bad request: that request gets
        ``finish_reason="error"`` and an ``error`` naming its ``request_id``. ``on_token(request_id, token_id)``
        is called for each sampled token as it is produced (engines that cannot stream call it for each token after
        the request finishes)."""
        ...

    def release(self, cache_keys: list[Any]) -> None:
        """Drop cached KV states the caller will not reuse."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the policy weights (the weight push after a learner update)."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters since the last call: generated tokens, prefilled tokens, reused (cached) tokens, seconds."""
        ...

    def close(self) -> None:
        """Free what the engine holds (actors, engine processes, caches). Idempotent."""
        ...
