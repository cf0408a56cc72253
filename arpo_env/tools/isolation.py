"""The isolation the Python tool achieves, as a level, and the one check the server and training make on it.

Levels, weakest first (measured by the tool's self-test, see :meth:`PythonTool.isolation`):

* ``unisolated``: the code can reach the network, or runs as the server's own user and sees the host's files.
* ``process``: no network (a network namespace with only a loopback device that is down) and a separate, per-call
  unprivileged uid; it still reads world-readable host files (the ``subprocess`` backend as root).
* ``filesystem``: no network and a filesystem of its own: the interpreter read-only, its scratch folder, a private
  ``/tmp`` and ``/dev/shm`` (``bwrap``, ``docker``).

The minimum (:data:`MIN_LEVEL`) is ``process``: no network and not the server's own user. Below it the tool refuses
to start unless the caller opts in with ``allow_unisolated_python=True`` (CLI: ``--allow-unisolated-python``),
which gives up that guarantee: the model's code then runs with the server's rights or the network.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from arpo_base.errors import ConfigError

LEVELS = ("unisolated", "process", "filesystem")
MIN_LEVEL = "process"
OPT_IN_HINT = ("install bubblewrap (apt-get install bubblewrap) or run as root so each call gets its own uid; or "
               "accept running the model's code unisolated with allow_unisolated_python=True "
               "(CLI: --allow-unisolated-python)")
_log = logging.getLogger(__name__)
_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


def level_of(backend: str, facts: dict, host_uid: int) -> str:
    """The level that the self-test's ``facts`` (uid, network interfaces, whether a host file is visible) prove."""
    no_network = set(facts["ifaces"]) <= {"lo"}
    own_files = not facts["canary_visible"]
    if no_network and own_files and backend in ("bwrap", "docker"):
        return "filesystem"
    if no_network and facts["uid"] != host_uid:
        return "process"
    return "unisolated"


def at_least(level: str, minimum: str = MIN_LEVEL) -> bool:
    """Whether ``level`` meets ``minimum`` (both from :data:`LEVELS`)."""
    return LEVELS.index(level) >= LEVELS.index(minimum)


def describe(backend: str, facts: dict, uid: int | None, host_uid: int) -> str:
    """One line naming what holds and what does not."""
    parts = [f"backend {backend}"]
    no_network = set(facts["ifaces"]) <= {"lo"}
    parts.append("network namespace (no network, 127.0.0.1 included)" if no_network
                 else "NETWORK REACHABLE (no network namespace)")
    if uid is not None:
        parts.append(f"per-call uid from {uid}")
    elif facts["uid"] == host_uid:
        parts.append("runs as the server's own user" + (" inside a user namespace" if backend == "bwrap" else ""))
    else:
        parts.append(f"runs as uid {facts['uid']}")
    if backend in ("bwrap", "docker") and not facts["canary_visible"]:
        parts.append("private filesystem (interpreter read-only, scratch, private /tmp and /dev/shm)")
    elif not facts["canary_visible"]:
        parts.append("private /tmp, /var/tmp and /dev/shm; other host files readable where world-readable")
    else:
        parts.append("host files readable (and writable where world-writable)")
    return "; ".join(parts)


def require_python_isolation(python_spec: dict | None = None, *, allow_unisolated_python: bool = False,
                             context: str = "training") -> dict[str, Any]:
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
    from arpo_env.tools.python_tool import PythonTool

    spec = dict(python_spec or {})
    allowed = bool(allow_unisolated_python or spec.get("allow_unisolated_python", False))
    spec["allow_unisolated_python"] = True  # judged here, with the context in the message
    record = dict(PythonTool(**spec).isolation)
    ok = at_least(record["level"])
    if not ok and not allowed:
        raise ConfigError(f"{context}: the Python tool's sandbox reaches level {record['level']!r}, below the "
                          f"minimum {MIN_LEVEL!r} (no network and not the server's own user): {record['detail']}",
                          hint=OPT_IN_HINT)
    if not ok:
        with _WARNED_LOCK:
            first = (context, record["level"]) not in _WARNED
            _WARNED.add((context, record["level"]))
        if first:
            _log.warning("%s: the Python tool runs the model's code UNISOLATED (allow_unisolated_python): %s",
                         context, record["detail"])
    record.update(minimum=MIN_LEVEL, meets_minimum=ok, allowed_unisolated=not ok)
    return record


def network_required(allow_unisolated_python: bool, require_network_isolation: bool | None) -> bool:
    """``require_network_isolation``: True or False as given; None (the default) follows the opt-in, so without
    ``allow_unisolated_python`` the network must be isolated."""
    return not allow_unisolated_python if require_network_isolation is None else require_network_isolation


def check_level(record: dict, allow_unisolated_python: bool, require_network_isolation: bool | None) -> None:
    """The tool's own refusal at construction: below :data:`MIN_LEVEL` without the opt-in, or without network
    isolation while it is required (:func:`network_required`)."""
    if network_required(allow_unisolated_python, require_network_isolation) and not record["network_isolation"]:
        raise ConfigError("the Python tool's sandbox has no network isolation, which is required: "
                          + record["detail"], hint="allow_unisolated_python=True (CLI: --allow-unisolated-python) "
                          "runs the model's code with network access, unless require_network_isolation=True")
    if not at_least(record["level"]) and not allow_unisolated_python:
        raise ConfigError(f"the Python tool's sandbox reaches level {record['level']!r}, below the minimum "
                          f"{MIN_LEVEL!r} (no network and not the server's own user): {record['detail']}",
                          hint=OPT_IN_HINT)


def require_env_python_isolation(env_config: dict, *, allow_unisolated_python: bool = False,
                                 context: str = "training") -> dict | None:
    """:func:`require_python_isolation` for the Python tool an environment config builds (its ``tools.python``
    section, or the task's default tools); None when it builds no Python tool.

    With ``allow_unisolated_python`` (a CLI's ``--allow-unisolated-python``) and a level below the minimum, the opt-in
    is written into ``env_config["tools"]["python"]`` (in place), so the tools that rollout workers build accept it."""
    from arpo_env.core import COMMON_DEFAULTS, _default_tool_spec
    from arpo_env.tasks.registry import task_spec

    tools = env_config.get("tools")
    if tools is None:
        if "python" not in task_spec(env_config.get("task", COMMON_DEFAULTS["task"])).tools:
            return None
        spec: dict = {}
    elif isinstance(tools, dict) and "python" in tools:
        spec = dict(tools["python"] or {})
    else:
        return None
    record = require_python_isolation(spec, allow_unisolated_python=allow_unisolated_python, context=context)
    if allow_unisolated_python and not record["meets_minimum"]:
        if tools is None:  # the task's default tools, made explicit to carry the opt-in
            tools = env_config["tools"] = _default_tool_spec({**COMMON_DEFAULTS, **env_config})
        tools["python"] = {**spec, "allow_unisolated_python": True}
    return record
