"""The tool contract shared by every arpo tool: ``ToolResult``, the ``Tool`` protocol and schema generation.

A tool is any callable object with a ``name``, ``__call__(**kwargs) -> ToolResult`` and ``schema()``. Tools never
raise on bad arguments coming from the policy: a wrong type, an empty or oversized argument, or an unexpected keyword
all come back as ``ToolResult(error=True, text=<clear message>)`` so a rollout can never be stopped by model output.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class ToolResult:
    """What a tool call produced.

    Attributes:
        text: The result text, without ``<result>`` tags (the protocol adds those).
        error: True when the call failed (bad arguments, timeout, traceback, HTTP failure, cache miss in
            ``on_miss="error"`` mode). The text then explains the failure.
        latency_s: Wall-clock seconds the call took (a cache hit reports the lookup time).
        cache_hit: True when the result was served by a ``ToolCache``.
        meta: Tool-specific details, e.g. ``{"timed_out": True, "network_isolated": True, "truncated": True}``.
    """

    text: str
    error: bool = False
    latency_s: float = 0.0
    cache_hit: bool = False
    meta: dict = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    """Every tool: never raises on bad arguments; returns ``ToolResult(error=True, text=msg)`` instead."""

    name: str

    def __call__(self, **kwargs: Any) -> ToolResult: ...

    def schema(self) -> dict: ...


_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_ANNOTATION_NAMES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into its description and a ``{arg: description}`` map."""
    doc = inspect.cleandoc(doc or "")
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    match = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)+)", doc, flags=re.M)
    if match:
        current = None
        for line in match.group(1).splitlines():
            item = re.match(r"^\s{2,8}(\w+)(?: \([^)]*\))?:\s*(.*)$", line)
            if item:
                current = item.group(1)
                args[current] = item.group(2).strip()
            elif current and line.strip():
                args[current] += " " + line.strip()
    return description, args


def function_schema(name: str, fn: Callable[..., Any]) -> dict:
    """Build an OpenAI/Hermes function schema from a callable's signature and Google-style docstring.

    Args:
        name: The function name the model must use.
        fn: The callable (usually a tool's bound ``__call__``); ``self`` and ``**kwargs`` are skipped.

    Returns:
        ``{"type": "function", "function": {"name", "description", "parameters": {...JSON schema...}}}``.
    """
    description, arg_docs = _docstring_parts(fn.__doc__ or "")
    properties: dict[str, dict] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        ann = param.annotation
        json_type = _TYPE_NAMES.get(ann) or _ANNOTATION_NAMES.get(str(ann), "string")
        properties[param.name] = {"type": json_type, "description": arg_docs.get(param.name, "")}
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def tolerant_call(method: Callable[..., ToolResult]) -> Callable[..., ToolResult]:
    """Decorate a tool's ``__call__`` so missing or unexpected keyword arguments return an error result.

    The signature (and so ``schema()``) is unchanged: ``inspect.signature`` follows ``__wrapped__``.
    """
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> ToolResult:
        try:
            signature.bind(self, *args, **kwargs)
        except TypeError as exc:
            expected = ", ".join(p for p in signature.parameters if p != "self")
            return ToolResult(
                text=f"Invalid arguments for {self.name}: {exc}. Expected: {expected}.",
                error=True,
                meta={"invalid_arguments": True},
            )
        return method(self, *args, **kwargs)

    return wrapper


def check_text_arg(value: Any, arg: str, max_chars: int) -> str | None:
    """Validate a string argument coming from the policy.

    Args:
        value: The value the model produced.
        arg: The argument name (used in the message).
        max_chars: The largest accepted length.

    Returns:
        None when the value is acceptable, otherwise an error message for ``ToolResult.text``.
    """
    if not isinstance(value, str):
        return f"Invalid argument '{arg}': expected a string, got {type(value).__name__}."
    if not value.strip():
        return f"Invalid argument '{arg}': it is empty."
    if len(value) > max_chars:
        return f"Invalid argument '{arg}': {len(value)} characters exceeds the limit of {max_chars}."
    return None


def truncate_text(text: str, max_chars: int) -> tuple[str, bool]:
    """Cap ``text`` at ``max_chars`` characters with a visible marker saying how much was dropped."""
    if len(text) <= max_chars:
        return text, False
    dropped = len(text) - max_chars
    return text[:max_chars] + f"\n... [output truncated: {dropped} more characters not shown]", True
