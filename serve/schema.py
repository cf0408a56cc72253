"""OpenAI chat-completions request validation: every client mistake becomes an :class:`APIError` (HTTP 400/404).

The error body has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and ``param`` names the
offending field the way OpenAI does (``messages[2].role``, ``temperature``). Nothing here touches a model, so the
checks are cheap and run before a request takes a batch slot. Checks that need the tokenizer (a prompt longer than
the model's context) live with the agent.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from arpo_base.options import closest
from serve.errors import APIError as APIError  # where every module of serve finds it
from serve.openai_api import NEUTRAL, NEUTRAL_ONLY, check_fields, check_logprobs, check_tool_shapes
from serve.record import check_episode_id

ROLES = ("system", "user", "assistant", "tool", "developer")
#: Bounds of one request (docs/security.md): each keeps one client from taking a replica's memory or time.
MAX_N = 16
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 256
#: Deepest nesting of a request body (a chat request needs 5: body, messages, message, content parts, part).
MAX_DEPTH = 32
#: ``n`` times the tool calls each choice may make (the agent's limit, or the request's lower one).
MAX_REQUEST_TOOL_CALLS = 64
TOOL_MODES = ("server", "client")
#: Parameters we read.
KNOWN = {
    "model",
    "messages",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "logprobs",
    "top_logprobs",
    "arpo",
}
ARPO_KEYS = {"tool_mode", "max_tool_calls", "episode", "task"}


@dataclass
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body (defaults as OpenAI's, except ``max_tokens``: see app)."""

    model: str
    messages: list[dict[str, Any]]
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    tool_mode: str = "server"
    max_tool_calls: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict[str, Any]] = field(default_factory=list)
    episode: str | None = None
    task: str | None = None  # the task an episode works on: recorded episodes of one task are a training group


def _number(body: dict, key: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(f"'{key}' must be a number, got {json.dumps(v)}", param=key)
    if v < lo or v > hi or (lo_open and v == lo):
        bracket = "(" if lo_open else "["
        raise APIError(f"'{key}' must be in {bracket}{lo:g}, {hi:g}], got {v}", param=key)
    return float(v)


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(f"'{key}' must be an integer, got {json.dumps(v)}", param=key)
    if v < lo or (hi is not None and v > hi):
        raise APIError(
            f"'{key}' must be >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {v}", param=key
        )
    return v


def _content(msg: dict, i: int, *, optional: bool) -> str | None:
    c = msg.get("content")
    where = f"messages[{i}].content"
    if c is None:
        if optional:
            return None
        raise APIError(f"'{where}' is required for role '{msg.get('role')}'", param=where)
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # OpenAI content parts: only text parts make sense for a text-only agent
        out = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    f'\'{where}[{j}]\' must be a text part {{"type": "text", "text": ...}}', param=f"{where}[{j}]"
                )
            out.append(part["text"])
        return "".join(out)
    raise APIError(f"'{where}' must be a string or a list of text parts, got {type(c).__name__}", param=where)


def _messages(body: dict) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError("'messages' is required", param="messages")
    if not isinstance(msgs, list):
        raise APIError(f"'messages' must be a list of message objects, got {type(msgs).__name__}", param="messages")
    if not msgs:
        raise APIError("'messages' must not be empty", param="messages")
    if len(msgs) > MAX_MESSAGES:
        raise APIError(f"'messages' takes at most {MAX_MESSAGES} messages, got {len(msgs)}", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(f"'messages[{i}]' must be an object, got {type(m).__name__}", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(
                f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                param=f"messages[{i}].role",
            )
        role = "system" if role == "developer" else role
        content = _content(m, i, optional=role == "assistant" and bool(m.get("tool_calls")))
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        if role == "assistant" and m.get("tool_calls") is not None:
            if not isinstance(m["tool_calls"], list):
                raise APIError(f"'messages[{i}].tool_calls' must be a list", param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = m["tool_calls"]
        out.append(msg)
    if out[-1]["role"] == "assistant":
        raise APIError(
            "the last message must not be an assistant message (nothing to answer)",
            param=f"messages[{len(out) - 1}].role",
        )
    return out


def _ext_int(ext: dict, key: str, lo: int, hi: int) -> int | None:
    try:
        return _int(ext, key, lo, hi)
    except APIError as e:
        raise APIError(e.message.replace(f"'{key}'", f"'arpo.{key}'"), param=f"arpo.{key}") from None


def _stop(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    items = [s] if isinstance(s, str) else s
    if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
        raise APIError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(items) > MAX_STOP:
        raise APIError(f"'stop' takes at most {MAX_STOP} strings, got {len(items)}", param="stop")
    longest = max(len(x) for x in items) if items else 0
    if longest > MAX_STOP_CHARS:
        raise APIError(f"a 'stop' string has at most {MAX_STOP_CHARS} characters, got {longest}", param="stop")
    return list(items)


def _unknown(body: dict) -> None:
    for key in body:
        if key not in KNOWN and key not in NEUTRAL and key not in NEUTRAL_ONLY:
            close = closest(key, KNOWN)
            hint = f"; did you mean '{close}'?" if close else ""
            raise APIError(f"unrecognized request argument supplied: '{key}'{hint}", param=key)


def _tool_mode(body: dict, ext: dict) -> str:
    tools = body.get("tools")
    mode = ext.get("tool_mode", "client" if tools else "server")
    if mode not in TOOL_MODES:
        raise APIError(
            f"'arpo.tool_mode' must be one of {', '.join(TOOL_MODES)}, got {json.dumps(mode)}", param="arpo.tool_mode"
        )
    if body.get("tool_choice") not in (None, "auto"):
        raise APIError(
            "'tool_choice' supports only \"auto\": a trained agent decides itself when to call its tools",
            param="tool_choice",
        )
    return mode


def _plain_text(body: Any) -> None:
    """Refuse (400) a body nested deeper than :data:`MAX_DEPTH` or holding a string that is not Unicode text (a lone
    surrogate from a ``\\ud800`` escape): either would fail later, inside a tokenizer or an encoder, as a 500."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(f"the request body nests deeper than {MAX_DEPTH} levels", param=None)
        if isinstance(value, dict):
            stack.extend((k, depth) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(
                    "the request body holds a string that is not valid Unicode (a lone surrogate escape "
                    "such as \\ud800)",
                    param=None,
                ) from None


def parse_chat_request(raw: bytes | str | dict, *, max_n: int = MAX_N) -> ChatRequest:
    """Validate a request body (raw bytes, text or an already decoded object) into a :class:`ChatRequest`."""
    if isinstance(raw, (bytes, str)):
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}", param=None) from None
        except RecursionError:
            raise APIError(f"the request body nests deeper than {MAX_DEPTH} levels", param=None) from None
    else:
        body = raw
    _plain_text(body)
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    _unknown(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError("'model' is required and must be a non-empty string (GET /v1/models lists them)", param="model")
    ext = body.get("arpo") or {}
    if not isinstance(ext, dict) or set(ext) - ARPO_KEYS:
        raise APIError(f"'arpo' must be an object with keys among {', '.join(sorted(ARPO_KEYS))}", param="arpo")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError("'stream_options' must be an object", param="stream_options")
    check_fields(body)
    logprobs, top_logprobs = check_logprobs(body)
    tools = check_tool_shapes(body.get("tools"))
    max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_completion_tokens", 1)
    return ChatRequest(
        model=model,
        messages=_messages(body),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        max_tokens=max_tokens,
        n=_int(body, "n", 1, max_n) or 1,
        stop=_stop(body),
        seed=_int(body, "seed", -(2**63), 2**63 - 1),
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        tool_mode=_tool_mode(body, ext),
        max_tool_calls=_ext_int(ext, "max_tool_calls", 0, 64),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        tools=tools,
        episode=None if ext.get("episode") is None else check_episode_id(ext["episode"]),
        task=None if ext.get("task") is None else check_episode_id(ext["task"], "arpo.task"),
    )
