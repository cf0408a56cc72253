"""The isolation the Python tool achieves, as a level, and the tool's own refusal below the minimum (the start-up
checks the server and training make: :mod:`arpo_env.tools.isolation_checks`).

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

from arpo_base.errors import ConfigError

LEVELS = ("unisolated", "process", "filesystem")
MIN_LEVEL = "process"
OPT_IN_HINT = ("install bubblewrap (apt-get install bubblewrap) or run as root so each call gets its own uid; or "
               "accept running the model's code unisolated with allow_unisolated_python=True "
               "(CLI: --allow-unisolated-python)")


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
