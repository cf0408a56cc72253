"""Tools for tool-using agents: a sandboxed Python interpreter, search (BM25 / replay / web) and a result cache.

``build_tools(spec)`` builds them from a plain dict, strictly: an unknown key raises ``ConfigError`` naming it::

    build_tools({
        "python": {"timeout_s": 10},
        "search": {"backend": "replay", "cache_json": ".../search_cache.json"},
        "cache": {"path": "~/.cache/arpo/tool_cache/tools.sqlite", "mode": "read_write"},
    })
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from arpo_base.errors import ConfigError
from arpo_base.options import check_choice, check_keys
from arpo_env.tools.base import Tool, ToolResult, function_schema
from arpo_env.tools.cache import CachedTool, ToolCache, cache_key
from arpo_env.tools.isolation_checks import require_env_python_isolation, require_python_isolation
from arpo_env.tools.python_tool import PythonTool, SandboxError, sandbox_capabilities, set_max_concurrency
from arpo_env.tools.search import (
    BM25Backend,
    ReplayBackend,
    SearchBackend,
    SearchError,
    SearchTool,
    WebBackend,
    format_snippets,
)

__all__ = [
    "BM25Backend",
    "CachedTool",
    "PythonTool",
    "ReplayBackend",
    "SandboxError",
    "SearchBackend",
    "SearchError",
    "SearchTool",
    "Tool",
    "ToolCache",
    "ToolResult",
    "WebBackend",
    "build_tools",
    "cache_key",
    "format_snippets",
    "function_schema",
    "require_env_python_isolation",
    "require_python_isolation",
    "sandbox_capabilities",
    "set_max_concurrency",
]

_SEARCH_BACKENDS: dict[str, Callable[..., Any]] = {"bm25": BM25Backend, "replay": ReplayBackend, "web": WebBackend}
_SEARCH_TOOL_KEYS = ("max_results", "result_length", "max_query_chars")


def _check_keys(section: str, given: dict, target: Callable[..., Any], extra: tuple[str, ...] = ()) -> None:
    """Raise ConfigError naming the first key that ``target`` (a class or function) does not accept."""
    allowed = set(inspect.signature(target).parameters) - {"self"} | set(extra)
    check_keys(given, allowed, f"tools.{section}")


def _build_search(spec: dict) -> SearchTool:
    spec = dict(spec)
    if "backend" not in spec:
        raise ConfigError("tools.search needs a 'backend' key: one of " + ", ".join(_SEARCH_BACKENDS))
    name = spec.pop("backend")
    check_choice("backend", name, tuple(_SEARCH_BACKENDS), "tools.search")
    backend_cls = _SEARCH_BACKENDS[name]
    _check_keys("search", spec, backend_cls, _SEARCH_TOOL_KEYS)
    tool_kwargs = {k: spec.pop(k) for k in _SEARCH_TOOL_KEYS if k in spec}
    return SearchTool(backend_cls(**spec), **tool_kwargs)


def build_tools(spec: dict) -> dict[str, Tool]:
    """Build the tools named in ``spec``.

    Args:
        spec: ``{"python": {PythonTool kwargs}, "search": {"backend": "bm25"|"replay"|"web", backend kwargs,
            max_results, result_length}, "cache": {"path", "mode", "on_miss"}}``. Every section is optional;
            with ``cache`` every tool is wrapped in a ``CachedTool`` sharing one ``ToolCache``.

    Returns:
        ``{tool.name: tool}``, e.g. ``{"python": ..., "search": ...}``.

    Raises:
        ConfigError: An unknown section or key (named in the message), or an invalid value.
    """
    if not isinstance(spec, dict):
        raise ConfigError(f"tools spec must be a dict, got {type(spec).__name__}")
    check_keys(spec, ("python", "search", "cache"), "tools")
    tools: dict[str, Tool] = {}
    if "python" in spec:
        _check_keys("python", spec["python"], PythonTool)
        tools["python"] = PythonTool(**spec["python"])
    if "search" in spec:
        tools["search"] = _build_search(spec["search"])
    if "cache" in spec:
        _check_keys("cache", spec["cache"], ToolCache)
        if "path" not in spec["cache"]:
            raise ConfigError("tools.cache needs a 'path' key (an SQLite file)")
        cache = ToolCache(**spec["cache"])
        if cache.mode != "off" and getattr(tools.get("python"), "persistent", False):
            raise ConfigError(
                "tools.cache cannot hold a persistent python tool's results: a call's output depends "
                "on the calls before it",
                hint='set tools.cache.mode = "off", or tools.python.persistent = false',
            )
        if cache.mode != "off":
            tools = {name: CachedTool(tool, cache) for name, tool in tools.items()}
    return tools
