"""The tool registry: every tool kind in ONE place, as tasks have theirs (:mod:`arpo_env.tasks.registry`).

A new tool is one :class:`ToolSpec` passed to :func:`register_tool` (the built-in ``python`` and ``search`` tools
register in :mod:`arpo_env.tools`): its name, its tag in the tag protocol (``<python>CODE</python>``), the keyword
argument the tag's text is passed as, and how it is built from its settings section. :func:`arpo_env.tools.build_tools`
(the ``tools`` settings), :mod:`arpo_env.protocol` (parsing and rendering tool calls), the reward's format check
(:func:`arpo_env.rewards.validate_format`) and the task defaults all read it. ``examples/extend/tool.py`` adds one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from arpo_base.errors import ConfigError
from arpo_base.options import check_keys


@dataclass(frozen=True)
class ToolSpec:
    """One tool kind.

    Attributes:
        name: The tool's name: its section of the ``tools`` settings (``tools.<name>``) and the name the policy's
            calls and the JSON protocol use.
        arg: The keyword argument the text between the tags is passed as (``code`` for ``PythonTool(code=...)``).
        build: Builds the tool from its settings section, given as keyword arguments (usually the tool's class). Its
            parameters are the section's keys: an unknown key is refused naming the tool and the closest key. A
            ``build`` that takes ``**settings`` checks its keys itself.
        tag: The tag of the arpo tag protocol, ``<tag>ARG</tag>`` (empty: the name).
        defaults: ``defaults(env_config) -> settings``: the section used when a task lists the tool among its default
            tools and the config gives none (None: ``{}``, the build's own defaults).
    """

    name: str
    arg: str
    build: Callable[..., Any]
    tag: str = ""
    defaults: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not self.tag:
            object.__setattr__(self, "tag", self.name)

    def check_settings(self, settings: Mapping[str, Any], extra: tuple[str, ...] = ()) -> None:
        """Raise ConfigError naming the first key of ``tools.<name>`` that :attr:`build` does not take."""
        check_settings(f"tools.{self.name}", settings, self.build, extra)

    def make(self, settings: Mapping[str, Any]) -> Any:
        """The tool built from its settings section (keys checked first)."""
        self.check_settings(settings)
        return self.build(**settings)


#: tool name -> its spec, in registration order (the order of the built tools and of the protocol's stop strings).
TOOLS: dict[str, ToolSpec] = {}

#: A ``tools`` section that is not a tool: every tool's results are kept in one shared cache.
WRAPPER_SECTIONS = ("cache",)


def check_settings(
    section: str, given: Mapping[str, Any], target: Callable[..., Any], extra: tuple[str, ...] = ()
) -> None:
    """Raise ConfigError naming the first key of ``section`` that ``target`` (a class or a function) does not accept;
    a target that takes ``**kwargs`` accepts any key (it checks them itself). Not a mapping: ConfigError."""
    if not isinstance(given, Mapping):
        raise ConfigError(f"{section} must be a table/dict, got {type(given).__name__}: {given!r}")
    params = inspect.signature(target).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    check_keys(given, set(params) - {"self"} | set(extra), section)


def register_tool(spec: ToolSpec) -> ToolSpec:
    """Add a tool kind (the same spec again is a no-op); returns the spec."""
    if spec.name in WRAPPER_SECTIONS:
        raise ConfigError(f"tool name {spec.name!r} is taken by the tools.{spec.name} section")
    if spec.name in TOOLS and TOOLS[spec.name] != spec:
        raise ConfigError(f"tool {spec.name!r} is already registered with another spec")
    clash = next((s.name for s in TOOLS.values() if s.tag == spec.tag and s.name != spec.name), None)
    if clash is not None:
        raise ConfigError(f"tool {spec.name!r}: the tag <{spec.tag}> is already the tag of tool {clash!r}")
    TOOLS[spec.name] = spec
    return spec


def tool_tags() -> tuple[str, ...]:
    """Every registered tool's tag, in registration order."""
    return tuple(spec.tag for spec in TOOLS.values())


def default_settings(names: tuple[str, ...] | list[str], env_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tools`` settings of a task's default tools ``names`` (each tool's :attr:`ToolSpec.defaults`)."""
    out: dict[str, Any] = {}
    for name in names:
        spec = TOOLS.get(name)
        out[name] = spec.defaults(env_config) if spec is not None and spec.defaults is not None else {}
    return out
