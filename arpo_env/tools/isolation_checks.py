"""The start-up checks of the Python tool's isolation: the training driver and the server call them once, before any
model-written code runs, and record the level they return (levels and the tool's own refusal:
:mod:`arpo_env.tools.isolation`)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from arpo_base.errors import ConfigError
from arpo_env.tasks.registry import DEFAULT_TASK, task_spec
from arpo_env.tools.isolation import MIN_LEVEL, OPT_IN_HINT, at_least
from arpo_env.tools.python_tool import PythonTool
from arpo_env.tools.registry import default_settings

_log = logging.getLogger(__name__)
#: (context, level) pairs already warned about: a downgrade is announced once per process, not per tool.
_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


def require_python_isolation(
    python_spec: dict | None = None, *, allow_unisolated_python: bool = False, context: str = "training"
) -> dict[str, Any]:
    """Build the Python tool of ``python_spec`` (its self-test runs) and require :data:`MIN_LEVEL`.

    Call it once at start-up (training driver, server); write the returned record into the run folder.

    Args:
        python_spec: The ``tools.python`` section (``PythonTool`` keyword arguments); None: the defaults.
        allow_unisolated_python: Accept a level below the minimum (a CLI's ``--allow-unisolated-python``); the
            spec's own ``allow_unisolated_python`` key counts as well. Below the minimum a warning is logged once.
        context: Who asks (``"training"``, ``"serve"``), for the messages.

    Returns:
        ``{"level", "backend", "network_isolation", "separate_user", "private_filesystem", "detail",
        "minimum", "meets_minimum", "allowed_unisolated"}``.

    Raises:
        ConfigError: The sandbox does not work, or its level is below the minimum without the opt-in.
    """
    spec = dict(python_spec or {})
    allowed = bool(allow_unisolated_python or spec.get("allow_unisolated_python", False))
    spec["allow_unisolated_python"] = True  # judged here, with the context in the message
    record = dict(PythonTool(**spec).isolation)
    ok = at_least(record["level"])
    if not ok and not allowed:
        raise ConfigError(
            f"{context}: the Python tool's sandbox reaches level {record['level']!r}, below the "
            f"minimum {MIN_LEVEL!r} (no network and not the server's own user): {record['detail']}",
            hint=OPT_IN_HINT,
        )
    if not ok:
        with _WARNED_LOCK:
            first = (context, record["level"]) not in _WARNED
            _WARNED.add((context, record["level"]))
        if first:
            _log.warning(
                "%s: the Python tool runs the model's code UNISOLATED (allow_unisolated_python): %s",
                context,
                record["detail"],
            )
    record.update(minimum=MIN_LEVEL, meets_minimum=ok, allowed_unisolated=not ok)
    return record


def require_env_python_isolation(
    env_config: dict, *, allow_unisolated_python: bool = False, context: str = "training"
) -> dict | None:
    """:func:`require_python_isolation` for the Python tool an environment config builds (its ``tools.python``
    section, or the task's default tools); None when it builds no Python tool.

    With ``allow_unisolated_python`` (a CLI's ``--allow-unisolated-python``) and a level below the minimum, the opt-in
    is written into ``env_config["tools"]["python"]`` (in place), so the tools that rollout workers build accept it."""
    tools = env_config.get("tools")
    defaults = task_spec(env_config.get("task", DEFAULT_TASK)).tools if tools is None else ()
    if tools is None:
        if "python" not in defaults:
            return None
        spec: dict = {}
    elif isinstance(tools, dict) and "python" in tools:
        spec = dict(tools["python"] or {})
    else:
        return None
    record = require_python_isolation(spec, allow_unisolated_python=allow_unisolated_python, context=context)
    if allow_unisolated_python and not record["meets_minimum"]:
        if tools is None:  # the task's default tools, made explicit to carry the opt-in
            tools = env_config["tools"] = default_settings(defaults, env_config)
        tools["python"] = {**spec, "allow_unisolated_python": True}
    return record
