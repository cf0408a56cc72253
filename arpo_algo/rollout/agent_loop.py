"""The agent loop: generate -> parse the call -> run the tool -> append the result, for many conversations at once.

This is the seam the tree sampler, eval and serve all call. The turn-handling pieces (:class:`Conversation`,
:func:`absorb`, :func:`action_text`, :func:`apply_turn` and the two ``turn_from_*`` adapters) are shared with
:class:`arpo_algo.rollout.sampler.TreeSampler`, whose paths are conversations that can also branch; :func:`run_agents`
drives plain conversations (no tree) over :class:`arpo_env.session.ToolSession` objects. Tokens follow
:mod:`arpo_algo.rollout.layout`: the prompt ids, then sampled tokens (trained) and tool results (masked), nothing
re-tokenized. Seeding request ``n`` of conversation ``i`` with ``seeds[i](n)`` reproduces a GRPO training trajectory
exactly (train/serve parity).

Example::

    from arpo_env.session import ToolSession
    sessions = [ToolSession(tools={"python": {}}) for _ in range(4)]
    prompt = layout.prompt_ids(engine.tokenizer, [{"role": "system", "content": sessions[0].system_prompt()},
                                                  {"role": "user", "content": "What is 17 * 23?"}])
    traces = run_agents(engine, sessions, [prompt] * 4, SamplingParams(temperature=0.7), max_response_tokens=512)
    print(traces[0].text, traces[0].tool_calls)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from arpo_algo.rollout import layout
from arpo_algo.rollout.engines.base import Generation, GenRequest, RolloutEngine, SamplingParams
from arpo_base.errors import ConfigError

EventCallback = Callable[[int, dict[str, Any]], None]
#: The placeholder log-prob of a token appended without sampling it (the tool-limit EOS): unknown, not 0.0 (which
#: would claim probability 1). The position is marked in ``unsampled``; the learner scores it by its own log-prob
#: under the sampling policy version and leaves it out of the mismatch alarm. The mark, not this value, decides.
NOT_SAMPLED = float("nan")


@dataclasses.dataclass(eq=False)
class Conversation:
    """The token state of one conversation while it grows (the sampler's tree paths extend it)."""

    response: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    entropies: list[float] = dataclasses.field(default_factory=list)
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    turn_start: int = 0  # response index where the current turn's action text starts
    n_requests: int = 0
    generated: int = 0  # tokens this conversation sampled itself
    cache_key: Any = None
    prev_key: Any = None
    last_finish: str = ""
    engine_error: str | None = None
    done: bool = False
    finish_reason: str = ""
    unsampled: list[int] = dataclasses.field(default_factory=list)  # positions appended without sampling

    def add(self, ids: list[int], mask: list[int], logprobs: list[float], entropies: list[float]) -> None:
        self.response += ids
        self.mask += mask
        self.logprobs += [float(x) for x in logprobs]
        self.entropies += [float(x) for x in entropies]

    def truncate(self, n: int) -> None:
        for name in ("response", "mask", "logprobs", "entropies"):
            setattr(self, name, getattr(self, name)[:n])
        self.unsampled = [i for i in self.unsampled if i < n]

    def request(self, request_id: Any, prompt_ids: list[int], params: SamplingParams) -> GenRequest:
        """The next engine request: the whole context, with this conversation's last cache key as prefix hint."""
        self.n_requests += 1
        return GenRequest(
            request_id=request_id, token_ids=prompt_ids + self.response, params=params, prefix_key=self.cache_key
        )


@dataclasses.dataclass
class Turn:
    """What one environment or session step means for the token stream.

    Attributes:
        observation: Text to append (tokenized alone, masked) when the conversation goes on.
        done: The environment/session ended the conversation.
        truncated: It ended at the turn limit.
        action_kind: What the parser saw ("tool_call", "answer", "text", "invalid").
        append_eos: Append EOS (tool-call limit with ``on_tool_limit="end_with_eos"``).
        tool_call: The call record when a tool ran (tool, args, output, error, latency_s, cache_hit), else None.
        reward, reward_info: The environment's reward when it ended (sessions have none).
    """

    observation: str
    done: bool
    truncated: bool
    action_kind: str
    append_eos: bool = False
    tool_call: dict[str, Any] | None = None
    reward: float = 0.0
    reward_info: dict[str, Any] = dataclasses.field(default_factory=dict)


def _call_record(tool: Any, args: Any, output: Any, error: Any, latency_s: Any, cache_hit: Any) -> dict[str, Any]:
    return {
        "tool": tool,
        "args": dict(args or {}),
        "output": output,
        "error": bool(error),
        "latency_s": float(latency_s or 0.0),
        "cache_hit": bool(cache_hit),
    }


def turn_from_env(result: tuple, calls_so_far: int) -> Turn:
    """A gymnasium step tuple of a tool environment (``ToolTextEnv``) as a :class:`Turn`; a tool ran when the env's
    ``tool_calls`` counter moved past ``calls_so_far``."""
    obs, reward, terminated, truncated, info = result
    call = None
    if info.get("tool_calls", 0) > calls_so_far:
        call = _call_record(
            info["tool"],
            info.get("args"),
            info.get("tool_output"),
            info.get("tool_error"),
            info.get("latency_s"),
            info.get("cache_hit"),
        )
    return Turn(
        obs,
        bool(terminated or truncated),
        bool(truncated),
        str(info.get("kind", "")),
        bool(info.get("append_eos")),
        call,
        float(reward),
        dict(info.get("reward_info", {})),
    )


def turn_from_session(st: Any) -> Turn:
    """A :class:`arpo_env.session.SessionStep` as a :class:`Turn`."""
    call = None
    if st.tool_output is not None:
        call = _call_record(st.tool, st.args, st.tool_output, st.tool_error, st.latency_s, st.cache_hit)
    return Turn(st.observation, st.done, st.kind == "turn_limit", st.action_kind, st.append_eos, call)


def absorb(conv: Conversation, gen: Generation) -> int:
    """Append one generation's tokens (trained) to ``conv``; returns the response index where they start."""
    start = len(conv.response)
    conv.add(gen.token_ids, [1] * len(gen.token_ids), gen.logprobs, gen.entropies)
    conv.generated += len(gen.token_ids)
    conv.prev_key, conv.cache_key = conv.cache_key, gen.cache_key
    conv.last_finish = gen.finish_reason
    if gen.finish_reason == "error":
        conv.engine_error = gen.error or "engine error (no message)"
    return start


def action_text(tokenizer: Any, conv: Conversation, eos_id: int | None) -> str:
    """The current turn's text as the environment sees it (a trailing EOS dropped, special tokens kept)."""
    ids = conv.response[conv.turn_start :]
    return tokenizer.decode(ids[:-1] if ids and ids[-1] == eos_id else ids, skip_special_tokens=False)


#: Every label a trajectory's ``finish_reason`` takes.
FINISH_REASONS = ("answer", "eos", "length", "tool_limit", "turn_limit", "error")


def finish_reason(turn: Turn, conv: Conversation) -> str:
    """Why a conversation the environment ended, ended."""
    if turn.append_eos:
        return "tool_limit"
    if turn.truncated:
        return "turn_limit"
    if conv.engine_error:
        return "error"
    if turn.action_kind == "answer":
        return "answer"
    return "length" if conv.last_finish == "length" else "eos"


def apply_turn(
    conv: Conversation,
    turn: Turn,
    tokenizer: Any,
    eos_id: int | None,
    *,
    max_response_tokens: int,
    train_eos: bool = True,
    before_observation: Callable[[Conversation], None] | None = None,
) -> tuple[str, str]:
    """Apply one step's outcome to the token stream; returns ``(status, finish_reason)``.

    status: "continue" (the observation was appended, masked; the next turn starts), "finished" (the environment
    ended the conversation; its reward is in ``turn``) or "ended" (the conversation cannot go on although the
    environment still runs: EOS after an invalid call, engine error, or the token budget; an environment caller
    scores it by stepping an empty action). ``before_observation(conv)`` runs just before the result is appended.
    """
    if turn.tool_call is not None:
        conv.tool_calls.append(turn.tool_call)
    if turn.done:
        # Never sampled: its position is recorded in ``unsampled`` (the learner scores it itself; the NaN value is
        # only a placeholder). Invariant: the response never exceeds max_response_tokens, so at the budget the
        # conversation ends without it.
        if turn.append_eos and len(conv.response) < max_response_tokens:
            if eos_id is None:
                raise ConfigError(
                    "on_tool_limit='end_with_eos' needs an EOS token, and this tokenizer has none",
                    hint="set the tokenizer's eos_token, or choose another on_tool_limit",
                )
            conv.unsampled.append(len(conv.response))
            conv.add([eos_id], [1 if train_eos else 0], [NOT_SAMPLED], [0.0])
        return "finished", finish_reason(turn, conv)
    if conv.engine_error or conv.last_finish == "eos" or len(conv.response) >= max_response_tokens:
        reason = "error" if conv.engine_error else conv.last_finish
        return "ended", {"stop": "length"}.get(reason, reason)
    obs_ids = layout.observation_ids(tokenizer, turn.observation)
    if before_observation is not None:
        before_observation(conv)
    conv.add(obs_ids, [0] * len(obs_ids), [0.0] * len(obs_ids), [0.0] * len(obs_ids))
    conv.turn_start = len(conv.response)
    if len(conv.response) >= max_response_tokens:
        conv.truncate(max_response_tokens)
        return "ended", "length"
    return "continue", ""


def safe_call(fn: Callable[[str], Any], action: str) -> Any:
    """``fn(action)``, or the exception it raised (returned to the calling thread, which ends that conversation)."""
    try:
        return fn(action)
    except Exception as e:  # noqa: BLE001
        return e


@dataclasses.dataclass
class AgentTrace:
    """One finished conversation.

    Attributes:
        prompt_ids: The prompt tokens.
        response_ids: Every token after the prompt (sampled and tool results).
        trained_mask: 1 for sampled tokens, 0 for inserted tool-result tokens.
        logprobs, entropies: Sampling-time values per response token (0.0 for inserted tool-result tokens; the
            log-prob of an appended tool-limit EOS is the placeholder :data:`NOT_SAMPLED`).
        tool_calls: One dict per tool call: tool, args, output, error, latency_s, cache_hit.
        finish_reason: "answer", "eos", "length", "tool_limit", "turn_limit" or "error".
        text: The response decoded (special tokens skipped).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    trained_mask: list[int]
    logprobs: list[float]
    entropies: list[float]
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    text: str
    error: str | None = None
    unsampled: list[int] = dataclasses.field(default_factory=list)  # positions appended without sampling


def run_agents(
    engine: RolloutEngine,
    sessions: list[Any],
    prompts: list[list[int]],
    sampling: SamplingParams,
    *,
    max_response_tokens: int,
    seeds: list[Callable[[int], int | None]] | None = None,
    on_event: EventCallback | None = None,
    on_token: Callable[[int, int], None] | None = None,
    tool_workers: int = 1,
) -> list[AgentTrace]:
    """Run many conversations to the end, batched: one ``engine.generate`` call per round for all live ones.

    Args:
        engine: A :class:`~arpo_algo.rollout.engines.base.RolloutEngine`.
        sessions: One fresh session per conversation (``.step(action)`` and ``.stop_sequences``, like
            :class:`arpo_env.session.ToolSession`).
        prompts: Prompt token ids per conversation (:func:`arpo_algo.rollout.layout.prompt_ids`).
        sampling: Temperature/top-p/top-k/logprobs; ``max_new_tokens``, ``stop`` and ``seed`` are set per request.
        max_response_tokens: Budget per conversation of every token after the prompt (tool results included).
        seeds: Per conversation, request number -> seed (None = ``sampling.seed``).
        on_event: ``on_event(i, event)`` with event type "text" (the turn's text), "tool_call" (tool, args),
            "tool_result" (output, error, latency_s) and "done" (finish_reason).
        on_token: ``on_token(i, token_id)`` for every sampled token (as the engine streams it).
        tool_workers: Threads that run one round's tool calls concurrently.
    """
    if not len(sessions) == len(prompts) == (len(seeds) if seeds is not None else len(prompts)):
        raise ValueError("sessions, prompts and seeds must have the same length")
    tok, eos_id = engine.tokenizer, engine.tokenizer.eos_token_id
    convs = [Conversation() for _ in sessions]
    emit = on_event or (lambda i, e: None)
    stream = (lambda rid, t: on_token(rid[0], t)) if on_token is not None else None
    keys: set[Any] = set()
    pool = ThreadPoolExecutor(max_workers=tool_workers, thread_name_prefix="arpo-agents") if tool_workers > 1 else None
    try:
        while live := [i for i, c in enumerate(convs) if not c.done]:
            reqs = []
            for i in live:
                c = convs[i]
                seed = seeds[i](c.n_requests) if seeds is not None else sampling.seed
                params = dataclasses.replace(
                    sampling,
                    max_new_tokens=max_response_tokens - len(c.response),
                    stop=tuple(sessions[i].stop_sequences),
                    seed=seed,
                )
                reqs.append(c.request((i, c.n_requests), prompts[i], params))
            gens = engine.generate(reqs, on_token=stream)
            for i, gen in zip(live, gens):
                absorb(convs[i], gen)
                if gen.cache_key is not None:
                    keys.add(gen.cache_key)
            actions = [action_text(tok, convs[i], eos_id) for i in live]
            for i, a in zip(live, actions):
                emit(i, {"type": "text", "text": a})
            steps = list(
                pool.map(safe_call, [sessions[i].step for i in live], actions)
                if pool
                else map(safe_call, [sessions[i].step for i in live], actions)
            )
            for i, st in zip(live, steps):
                _apply_session_step(convs[i], st, i, tok, eos_id, max_response_tokens, emit)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        if keys:
            engine.release(sorted(keys, key=str))
    return [
        AgentTrace(
            p,
            c.response,
            c.mask,
            c.logprobs,
            c.entropies,
            c.tool_calls,
            c.finish_reason,
            tok.decode(c.response, skip_special_tokens=True),
            c.engine_error,
            list(c.unsampled),
        )
        for p, c in zip(prompts, convs)
    ]


def _apply_session_step(
    c: Conversation, st: Any, i: int, tok: Any, eos_id: int | None, max_response_tokens: int, emit: EventCallback
) -> None:
    if isinstance(st, BaseException):  # the session contract says never; if it happens, end this one only
        c.done, c.finish_reason, c.engine_error = True, "error", f"session step failed: {st!r}"
    else:
        turn = turn_from_session(st)
        if turn.tool_call is not None:
            emit(i, {"type": "tool_call", "tool": turn.tool_call["tool"], "args": turn.tool_call["args"]})
            emit(i, {"type": "tool_result", **{k: turn.tool_call[k] for k in ("output", "error", "latency_s")}})
        status, reason = apply_turn(c, turn, tok, eos_id, max_response_tokens=max_response_tokens)
        if status != "continue":
            c.done, c.finish_reason = True, reason
    if c.done:
        emit(i, {"type": "done", "finish_reason": c.finish_reason})
