"""The memory of process trees, read from ``/proc``: what the persistent interpreters' per-step memory figure
(``rollout/interpreter_pss_mib_peak``) measures."""

from __future__ import annotations

import os
from collections.abc import Iterable


def tree_pss(roots: Iterable[int]) -> int | None:
    """The summed proportional set size (PSS, bytes) of every process in the trees rooted at ``roots`` (host pids):
    the roots and all their descendants, found by one scan of ``/proc/*/stat``. PSS divides each page among the
    processes that map it, so the pages that forks share copy-on-write count once in the sum (RSS would count them
    once per fork). A process that ends during the walk is left out: it holds nothing any more. 0 for no roots.
    None when a process of the trees may not be read by this one: a sum without it would be too low, silently."""
    todo = list(roots)
    if not todo:
        return 0
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # after "(comm)": the state, then the parent's pid
        children.setdefault(ppid, []).append(int(name))
    total = 0
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                total += next((int(line.split()[1]) << 10 for line in f if line.startswith(b"Pss:")), 0)  # kB
        except (FileNotFoundError, ProcessLookupError):
            continue
        except PermissionError:
            return None
    return total
