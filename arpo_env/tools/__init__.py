"""Tools for tool-using agents: a sandboxed Python interpreter, search (BM25 / replay / web) and a result cache.

Every tool kind is a :class:`~arpo_env.tools.registry.ToolSpec` in the tool registry
(:mod:`arpo_env.tools.registry`); the built-in ``python`` and ``search`` register here. ``build_tools(spec)`` builds
them from a plain dict, strictly: an unknown key raises ``ConfigError`` naming it::

    build_tools({
        "python": {"timeout_s": 10},
        "search": {"backend": "replay", "cache_json": ".../search_cache.json"},
        "cache": {"path": "~/.cache/arpo/tool_cache/tools.sqlite", "mode": "read_write"},
    })
"""

from __future__ import annotations

from arpo_base.errors import ConfigError
from arpo_base.options import check_keys
from arpo_env.tools.base import Tool, ToolResult, function_schema
from arpo_env.tools.cache import CachedTool, ToolCache, cache_key
from arpo_env.tools.isolation_checks import require_env_python_isolation, require_python_isolation
from arpo_env.tools.python_tool import PythonTool, SandboxError, sandbox_capabilities, set_max_concurrency
from arpo_env.tools.registry import TOOLS, WRAPPER_SECTIONS, ToolSpec, check_settings, register_tool
from arpo_env.tools.search import (
    BM25Backend,
    ReplayBackend,
    SearchBackend,
    SearchError,
    SearchTool,
    WebBackend,
    build_search,
    format_snippets,
    replay_defaults,
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
    "TOOLS",
    "Tool",
    "ToolCache",
    "ToolResult",
    "ToolSpec",
    "WebBackend",
    "build_tools",
    "cache_key",
    "format_snippets",
    "function_schema",
    "register_tool",
    "require_env_python_isolation",
    "require_python_isolation",
    "sandbox_capabilities",
    "set_max_concurrency",
]

# The built-in tools; their order is the order of the built tools and of the tag protocol's stop strings.
register_tool(ToolSpec("python", "code", PythonTool))
register_tool(ToolSpec("search", "query", build_search, defaults=replay_defaults))


def build_tools(spec: dict) -> dict[str, Tool]:
    """Build the tools named in ``spec``.

    Args:
        spec: ``{"python": {PythonTool kwargs}, "search": {"backend": "bm25"|"replay"|"web", backend kwargs,
            max_results, result_length}, "cache": {"path", "mode", "on_miss"}}``, and a section per tool registered
            with :func:`register_tool` (its build's keyword arguments). Every section is optional; with ``cache``
            every tool is wrapped in a ``CachedTool`` sharing one ``ToolCache``.

    Returns:
        ``{tool.name: tool}``, e.g. ``{"python": ..., "search": ...}`` (in registration order).

    Raises:
        ConfigError: An unknown section or key (named in the message), or an invalid value.
    """
    if not isinstance(spec, dict):
        raise ConfigError(f"tools spec must be a dict, got {type(spec).__name__}")
    check_keys(spec, (*TOOLS, *WRAPPER_SECTIONS), "tools")
    tools: dict[str, Tool] = {name: tool.make(spec[name]) for name, tool in TOOLS.items() if name in spec}
    if "cache" in spec:
        check_settings("tools.cache", spec["cache"], ToolCache)
        if "path" not in spec["cache"]:
            raise ConfigError("tools.cache needs a 'path' key (an SQLite file)")
        cache = ToolCache(**spec["cache"])
        persistent = next((name for name, tool in tools.items() if getattr(tool, "persistent", False)), None)
        if cache.mode != "off" and persistent is not None:
            raise ConfigError(
                f"tools.cache cannot hold a persistent {persistent} tool's results: a call's output depends "
                "on the calls before it",
                hint=f'set tools.cache.mode = "off", or tools.{persistent}.persistent = false',
            )
        if cache.mode != "off":
            tools = {name: CachedTool(tool, cache) for name, tool in tools.items()}
    return tools
