"""What the OpenAI chat-completions fields mean on this server, beyond the fields :mod:`serve.schema` reads.

Invariant: a request field either acts or is refused. Fields that cannot change what a trained agent computes (an
end-user id, cache hints) are accepted as they are; fields that would change the answer are accepted only at their
neutral value (a penalty of 0, ``response_format`` text) and refused otherwise, naming the field and what to send.
A request's ``tools`` must be the agent's trained tools with their trained parameters: the agent can call nothing
else. The reference page (docs/reference/openai.md) lists every field with the test that covers it.

Also here: the ``logprobs`` entries of a choice (OpenAI's shape, from the engine's per-token log-probs) and the
Responses-style items that show a generic client the tool calls the server ran.
"""

from __future__ import annotations

import json
import math
from typing import Any

from serve.errors import APIError

#: Most ``top_logprobs`` a request may ask for (OpenAI's bound).
MAX_TOP_LOGPROBS = 20


def _is_zero(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v == 0


def _text_format(v: Any) -> bool:
    return isinstance(v, dict) and v.get("type") == "text" and set(v) <= {"type"}


#: Fields that would change the answer: ``key -> (is the value neutral?, the neutral value, why other values are
#: refused)``. ``None`` (JSON null) always passes, as the field left out.
NEUTRAL_ONLY: dict[str, tuple[Any, str, str]] = {
    "frequency_penalty": (_is_zero, "0", "the agent samples from its trained policy, unpenalized"),
    "presence_penalty": (_is_zero, "0", "the agent samples from its trained policy, unpenalized"),
    "logit_bias": (lambda v: v == {}, "{}", "the agent samples from its trained policy, unbiased"),
    "response_format": (
        _text_format,
        '{"type": "text"}',
        "the agent writes free text in its trained format; JSON modes and schemas are not enforced",
    ),
    "store": (lambda v: v is False, "false", "this server stores no completions"),
    "modalities": (lambda v: v == ["text"], '["text"]', "the agent reads and writes text only"),
    "audio": (lambda v: False, "null", "the agent writes text only"),
    "service_tier": (lambda v: v in ("auto", "default"), '"auto" or "default"', "this server has one service tier"),
    "verbosity": (lambda v: v == "medium", '"medium"', "the agent's answer length is its trained one"),
    "reasoning_effort": (lambda v: False, "null", "the agent is not a reasoning model with an effort setting"),
    "web_search_options": (lambda v: False, "null", "the agent's tools are its trained ones (see 'tools')"),
    "functions": (lambda v: v == [], "[]", "use 'tools' (the deprecated 'functions' is not read)"),
    "function_call": (
        lambda v: v == "auto",
        '"auto"',
        "use 'tool_choice' (the deprecated 'function_call' is not read)",
    ),
}


def _string(v: Any) -> bool:
    return isinstance(v, str)


#: Fields that cannot change what the agent computes, accepted with any value of their type: ``key -> (type check,
#: the type in words)``. ``user`` stays accepted: it may name an episode later.
NEUTRAL: dict[str, tuple[Any, str]] = {
    "user": (_string, "a string"),
    "safety_identifier": (_string, "a string"),
    "prompt_cache_key": (_string, "a string"),
    "metadata": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()), "a map of strings"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a boolean"),  # the agent calls one tool per turn
    "prediction": (lambda v: isinstance(v, dict), "an object"),  # a latency hint: the content is the same
}
#: ``stream_options`` keys: ``include_usage`` acts; ``include_obfuscation`` only pads chunks (none are padded here).
STREAM_OPTIONS = {"include_usage", "include_obfuscation"}


def check_fields(body: dict[str, Any]) -> None:
    """Refuse (400, naming the field) a neutral-only field set to another value, or a neutral field of the wrong
    type; every other field is :mod:`serve.schema`'s."""
    for key, (neutral, value, why) in NEUTRAL_ONLY.items():
        v = body.get(key)
        if v is not None and not neutral(v):
            raise APIError(
                f"'{key}' = {json.dumps(v)[:80]} is not supported: {why}; leave it out or send {value}", param=key
            )
    for key, (ok, kind) in NEUTRAL.items():
        v = body.get(key)
        if v is not None and not ok(v):
            raise APIError(f"'{key}' must be {kind}, got {json.dumps(v)[:80]}", param=key)
    opts = body.get("stream_options")
    if isinstance(opts, dict):
        for key in opts:
            if key not in STREAM_OPTIONS:
                raise APIError(
                    f"'stream_options.{key}' is not a stream option (known: {', '.join(sorted(STREAM_OPTIONS))})",
                    param=f"stream_options.{key}",
                )
            if not isinstance(opts[key], bool):
                raise APIError(f"'stream_options.{key}' must be a boolean", param=f"stream_options.{key}")


def check_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    """``(logprobs, top_logprobs)`` of a request: a boolean and an integer in [0, MAX_TOP_LOGPROBS] that needs
    ``logprobs`` true."""
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise APIError(f"'logprobs' must be a boolean, got {json.dumps(lp)[:80]}", param="logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return bool(lp), 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(
            f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {json.dumps(top)[:80]}",
            param="top_logprobs",
        )
    if not lp:
        raise APIError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    return True, top


def check_tool_shapes(tools: Any) -> list[dict[str, Any]]:
    """A request's ``tools``: a list of ``{"type": "function", "function": {"name", "parameters"?}}``."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError("'tools' must be a list of tool definitions", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(
                f'\'tools[{i}]\' must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                param=f"tools[{i}]",
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"'tools[{i}].function.name' must be a non-empty string", param=f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(f"'tools[{i}].function.parameters' must be a JSON schema object", param=f"tools[{i}]")
    return tools


def _signature(params: dict[str, Any] | None) -> tuple[dict[str, Any], set[str] | None]:
    """The parts of a parameters schema that decide which call the agent writes: each property's type, and the
    required names (None when not given)."""
    params = params or {}
    props = params.get("properties") or {}
    types = {k: (v.get("type") if isinstance(v, dict) else None) for k, v in props.items()}
    req = params.get("required")
    return types, (set(req) if isinstance(req, list) else None)


def check_tools(tools: list[dict[str, Any]], trained: dict[str, dict[str, Any]]) -> None:
    """Each requested tool must be one the agent was trained on (``trained``: name -> its function schema), with the
    trained parameters (property names and types; ``required``, when given, the trained one): the agent writes calls
    of those and nothing else. Descriptions may differ (the agent never reads them)."""
    for i, t in enumerate(tools):
        fn = t["function"]
        name = fn["name"]
        if name not in trained:
            can = ", ".join(sorted(trained)) or "none"
            raise APIError(
                f"'tools[{i}]': this agent cannot call '{name}' (it was trained on: {can}); send only those tools",
                param=f"tools[{i}].function.name",
            )
        want = trained[name]["function"].get("parameters")
        want_types, want_req = _signature(want)
        got_types, got_req = _signature(fn.get("parameters"))
        types_differ = set(got_types) != set(want_types) or any(
            got_types[k] is not None and got_types[k] != want_types[k] for k in got_types
        )
        if types_differ or (got_req is not None and got_req != (want_req or set())):
            raise APIError(
                f"'tools[{i}]': '{name}' takes other parameters than the agent was trained with; its trained "
                f"parameters are {json.dumps(want)}",
                param=f"tools[{i}].function.parameters",
            )


def logprob_problem(engine: str, engine_settings: dict[str, Any], temperature: float) -> str | None:
    """Why this agent's engine cannot report the request's log-probs (None when it can). Every value returned is
    ``log_softmax(logits / T)`` over the full vocabulary before ``top_p`` truncation (T = the request's
    temperature, 1 when it is 0): vLLM reports raw log-probs (T = 1) in its default mode and post-truncation ones in
    the other, so it serves them at temperature 0 or 1 in its default mode only."""
    if engine != "vllm":
        return None
    mode = engine_settings.get("logprobs_mode", "raw_logprobs")
    if mode != "raw_logprobs":
        return f"the vLLM engine runs with logprobs_mode={mode!r} (values after truncation); serve it with raw_logprobs"
    if temperature not in (0.0, 1.0):
        return (
            "the vLLM engine reports log-probs at temperature 1 only (its raw log-probs); ask with temperature 1 "
            "or 0, or serve the agent with the HF engine"
        )
    return None


def _entry(tok: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = tok.decode([token_id], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprob_entries(tok: Any, gen: Any, top: int) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` entries of one engine generation's sampled tokens: each token's log-prob and the
    ``top`` most likely tokens of its step (the engine's top list, cut to ``top``: an engine appends the sampled
    token after its top k when it is not among them)."""
    out = []
    tops = gen.top_logprobs or [[] for _ in gen.token_ids]
    for token_id, lp, pairs in zip(gen.token_ids, gen.logprobs, tops):
        e = _entry(tok, token_id, float(lp))
        e["top_logprobs"] = [_entry(tok, t, float(v)) for t, v in pairs[:top]]
        out.append(e)
    return out


def tool_items(call: dict[str, Any], call_id: str) -> list[dict[str, Any]]:
    """One tool call the server ran as OpenAI Responses items: a ``function_call`` and its ``function_call_output``
    (joined by ``call_id``). ``call`` is the agent's record: tool, args, output, error."""
    return [function_call_item(call, call_id), function_output_item(call, call_id)]


def function_call_item(call: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": call.get("tool"),
        "arguments": json.dumps(call.get("args") or {}),
        "status": "completed",
    }


def function_output_item(call: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": str(call.get("output") or "")}
