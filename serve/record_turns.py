"""What a recorded turn holds (:func:`turn_record`), and the prompt of a request that continues a recorded reply
(:func:`continuation_ids`): the recorded ids, never the reply re-tokenised (:mod:`serve.record` keeps the episodes).
"""

from __future__ import annotations

import json
from typing import Any

from arpo_algo.rollout.layout import observation_ids


def _calls(tool_calls: Any) -> list[tuple[Any, Any]] | None:
    """A message's tool calls as (name, parsed arguments): what a client sends back, ids and JSON spacing aside."""
    if not tool_calls:
        return None
    out = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return None
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            return None
        out.append((fn.get("name"), args))
    return out


def same_reply(choice: dict[str, Any], message: dict[str, Any]) -> bool:
    """Whether a client's assistant message is this recorded reply: the same text, or (a client that sends a tool
    call without its text, as OpenAI's SDKs do) the same tool calls."""
    if choice["content"] == message["content"]:
        return True
    calls = _calls(message.get("tool_calls"))
    return not message["content"] and calls is not None and [list(c) for c in calls] == choice.get("tool_calls")


def continuation_ids(tok: Any, session: Any, prev: dict[str, Any], messages: list[dict[str, Any]]) -> list[int] | None:
    """The prompt of a request that continues a recorded reply: the recorded prompt and reply ids, then the new
    messages' ids (tool results as training appends them, other messages as the chat template renders them after the
    reply). None when the new messages mix tool results and other roles (rendered afresh: a new segment)."""
    choice, n = prev["choice"], prev["n_messages"]
    new = messages[n + 1 :]
    ids = list(prev["prompt_ids"]) + list(choice["response_ids"])
    roles = {m["role"] for m in new}
    if roles == {"tool"}:
        for m in new:
            ids += observation_ids(tok, session.protocol.format_result(m["content"]))
        return ids
    if "tool" in roles or "assistant" in roles:
        return None
    # The reply's text is replaced by a mark no message holds, so where the template closes it is found whatever the
    # reply says (empty, or text the template would also write).
    mark = "\u2063arpo-reply\u2063"
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    plain[n] = {"role": "assistant", "content": mark}
    before = tok.apply_chat_template(plain[: n + 1], tokenize=False)
    after = tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before) or before.count(mark) != 1:
        return None
    closing = before[before.index(mark) + len(mark) :]  # what the template writes after a reply: its end-of-turn mark
    eos = tok.eos_token or ""
    if choice["response_ids"] and choice["response_ids"][-1] == tok.eos_token_id and closing.startswith(eos):
        closing = closing[len(eos) :]  # the model wrote the end-of-turn mark itself
    return ids + list(tok(closing + after[len(before) :], add_special_tokens=False)["input_ids"])


def unscoreable_reason(finish: str, temperature: float, top_p: float, logprob_problem: str | None) -> str | None:
    """Why the learner cannot score a recorded reply (None: it can)."""
    if logprob_problem:
        return f"no log-probs: {logprob_problem}"
    if finish == "length":
        return "truncated by the length limit"
    if temperature == 0:
        return "greedy decoding (temperature 0) has no sampling distribution to learn from"
    if top_p < 1:
        return f"top_p {top_p:g} < 1: the learner scores the full distribution"
    return None


def turn_record(spec: Any, job: Any, traces: list[Any], choices: list[dict[str, Any]], values: Any) -> dict[str, Any]:
    """What a turn's line holds beside its place in the episode: the prompt ids the engine was given, each choice's
    ids, trained mask, the log-probs of its sampled tokens (``values``: per choice, in order; None when the engine
    could not give them) and why the learner cannot score it, the sampling settings and the policy."""
    turn, sp = job.turn, job.sampling
    out = []
    for j, (trace, choice) in enumerate(zip(traces, choices)):
        finish = choice["message"]["arpo"]["finish_reason"]
        reason = unscoreable_reason(trace.finish_reason, sp.temperature, sp.top_p, turn.logprob_problem)
        out.append(
            {
                "index": j,
                "content": choice["message"]["content"],
                "tool_calls": [list(c) for c in _calls(choice["message"].get("tool_calls")) or []] or None,
                "finish_reason": finish,
                "response_ids": list(trace.response_ids),
                "trained_mask": list(trace.trained_mask),
                "logprobs": None if values is None else [float(v) for v in values[j]],
                "unscoreable": reason,
            }
        )
    return {
        "prompt_ids": list(job.prompt),
        "choices": out,
        "sampling": {
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "max_tokens": job.max_response_tokens,
            "seed": job.seed,
            "stop": list(job.stop),
            "n": job.n,
        },
        "policy": {"agent": spec.name, "fingerprint": spec.fingerprint or None, "adapter": bool(spec.base)},
    }
