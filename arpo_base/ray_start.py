"""Starting Ray for an arpo command: an address given explicitly (an argument, or ``RAY_ADDRESS``) is joined; with
none, the command starts a Ray of its own.

Invariant: no arpo command joins a cluster nobody named. Ray's own ``ray.init()`` without an address connects to the
cluster that the ``ray_current_cluster`` file in its temporary folder names, a folder every user of the machine shares
and that any ``ray start`` elsewhere rewrites: a stale file made a command hang on a dead cluster, and a live one would
put a server or a sweep on someone else's cluster with other settings. Every ``ray.init`` of arpo goes through
:func:`init_ray`, which passes ``address="local"`` (Ray: start a new local instance, whatever that file says) when no
address was given. Ray is imported only when called: this module stays pure Python.
"""

from __future__ import annotations

import os
from typing import Any


def ray_address(address: str | None = None) -> str | None:
    """The cluster to join: ``address`` when given, else ``RAY_ADDRESS`` when set (non-empty), else None (start
    a Ray of this command's own)."""
    return address or os.environ.get("RAY_ADDRESS", "").strip() or None


def init_ray(address: str | None = None, **options: Any) -> Any:
    """``ray.init(**options)`` joining :func:`ray_address` when there is one, else starting a new local Ray, never
    the cluster Ray's ``ray_current_cluster`` file names. Returns what ``ray.init`` returns."""
    import ray

    return ray.init(address=ray_address(address) or "local", **options)
