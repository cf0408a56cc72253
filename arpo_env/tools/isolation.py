"""The isolation the Python tool achieves, as a level, and the tool's own refusal below the minimum (the start-up
checks the server and training make: :mod:`arpo_env.tools.isolation_checks`).

Levels, weakest first, judged by what the tool's self-test could do from inside the sandbox (see
:meth:`PythonTool._self_test`): it plants host files of the server's user (a world-readable one, a 0600 one, one inside
a 0700 folder), listens on the host's 127.0.0.1, and the sandboxed probe tries to read each file and to connect:

* ``unisolated``: an attempt on the server's private files or on the listener succeeded, the code saw a network
  interface besides ``lo``, or it runs in a user namespace whose uid the host does not map (the kernel then treats
  it as the server's own user, whatever ``getuid()`` says inside).
* ``process``: every attempt on the private files and the network failed; world-readable host files remain readable
  (the ``subprocess`` backend as root: a per-call unprivileged uid, no network).
* ``filesystem``: every attempt failed, the world-readable file included: a filesystem of its own (``bwrap``,
  ``docker``).

The minimum (:data:`MIN_LEVEL`) is ``process``: no network and not the server's own user. Below it the tool refuses
to start unless the caller opts in with ``allow_unisolated_python=True`` (CLI: ``--allow-unisolated-python``),
which gives up that guarantee: the model's code then runs with the server's rights or the network.
"""

from __future__ import annotations

from arpo_base.errors import ConfigError

LEVELS = ("unisolated", "process", "filesystem")
MIN_LEVEL = "process"
OPT_IN_HINT = (
    "install bubblewrap (apt-get install bubblewrap) or run as root so each call gets its own uid; or "
    "accept running the model's code unisolated with allow_unisolated_python=True "
    "(CLI: --allow-unisolated-python)"
)


PUBLIC_ATTEMPT = "read a world-readable host file"


def network_isolated(facts: dict) -> bool:
    """No interface besides loopback, and the host's 127.0.0.1 listener was not reached."""
    return set(facts["ifaces"]) <= {"lo"} and facts["attempts"].get("connect to the host's 127.0.0.1") != "connected"


def failed(result: str) -> bool:
    """Whether one attempt of the self-test failed (its result is an error's name, not what the probe achieved)."""
    return not result.startswith(("read", "connected", "created"))


def level_of(backend: str, facts: dict, host_uid: int) -> str:
    """The level that the self-test's ``facts`` prove: its attempts, its network interfaces and whether its user
    namespace maps its uid (``host_uid``: the server's, kept for the callers' signature)."""
    held = all(
        failed(r) for name, r in facts["attempts"].items() if name not in (PUBLIC_ATTEMPT, "create a user namespace")
    )
    if not (held and network_isolated(facts)) or facts["userns"] != "mapped":
        return "unisolated"
    if not failed(facts["attempts"][PUBLIC_ATTEMPT]) or backend not in ("bwrap", "docker"):
        return "process"
    return "filesystem"


def at_least(level: str, minimum: str = MIN_LEVEL) -> bool:
    """Whether ``level`` meets ``minimum`` (both from :data:`LEVELS`)."""
    return LEVELS.index(level) >= LEVELS.index(minimum)


def describe(backend: str, facts: dict, uid: int | None, host_uid: int) -> str:
    """One line naming what holds and what does not."""
    parts = [f"backend {backend}"]
    no_network = network_isolated(facts)
    canary_visible = not failed(facts["attempts"][PUBLIC_ATTEMPT])
    parts.append(
        "network namespace (no network, 127.0.0.1 included)"
        if no_network
        else "NETWORK REACHABLE (no network namespace)"
    )
    if uid is not None:
        parts.append(f"per-call uid from {uid}")
    elif facts["userns"] != "mapped":
        parts.append("RUNS AS THE SERVER'S OWN USER (a user namespace without a mapped uid)")
    elif facts["uid"] == host_uid:
        parts.append("runs as the server's own user" + (" inside a user namespace" if backend == "bwrap" else ""))
    else:
        parts.append(f"runs as uid {facts['uid']}")
    leaked = [n for n, r in facts["attempts"].items() if n != PUBLIC_ATTEMPT and n.startswith("read") and not failed(r)]
    if leaked:
        parts.append("COULD " + " AND ".join(n.upper() for n in leaked))
    if backend in ("bwrap", "docker") and not canary_visible:
        parts.append("private filesystem (interpreter read-only, scratch, private /tmp and /dev/shm)")
    elif not canary_visible or uid is not None:
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
        raise ConfigError(
            "the Python tool's sandbox has no network isolation, which is required: " + record["detail"],
            hint="allow_unisolated_python=True (CLI: --allow-unisolated-python) "
            "runs the model's code with network access, unless require_network_isolation=True",
        )
    if not at_least(record["level"]) and not allow_unisolated_python:
        raise ConfigError(
            f"the Python tool's sandbox reaches level {record['level']!r}, below the minimum "
            f"{MIN_LEVEL!r} (no network and not the server's own user): {record['detail']}",
            hint=OPT_IN_HINT,
        )
