"""Censuses of processes that hold while processes end under them.

A process found by a census can exit, or exit and wait as a zombie for its parent to reap it, before the census reads
its name or command line; psutil then raises ``NoSuchProcess`` or ``ZombieProcess``. Every census in arpo and its tests
goes through these functions, which count a zombie as ended and skip a process that vanished, so what an earlier step
left behind cannot make a later census fail.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil


def _is_zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.ZombieProcess:
        return True
    except psutil.NoSuchProcess:
        return False


def is_alive(p: psutil.Process) -> bool:
    """Whether ``p`` still runs: a zombie (ended, not yet reaped) and a vanished process are not alive."""
    try:
        return p.is_running() and not _is_zombie(p)
    except psutil.Error:
        return False


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """The living descendants of ``pid`` (this process by default), children's children included: zombies and
    processes that ended while the census looked are left out; an ended ``pid`` has none."""
    try:
        found = psutil.Process(os.getpid() if pid is None else pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in found if is_alive(p)]


def cmdline(p: psutil.Process) -> str | None:
    """``p``'s command line as one string, or None when it ended (or turned zombie) before it could be read."""
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # ZombieProcess is a NoSuchProcess
        return None


def name(p: psutil.Process) -> str | None:
    """``p``'s name, or None when it ended before it could be read."""
    try:
        return p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


@dataclass(frozen=True)
class Unreaped:
    """A zombie: a child that ended and that its parent has not waited for."""

    pid: int
    name: str
    parent_pid: int
    parent: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.name}), child of pid {self.parent_pid} ({self.parent})"


def unreaped(pid: int | None = None) -> list[Unreaped]:
    """The zombies among ``pid``'s descendants (this process by default), each with the parent that should reap it."""
    try:
        found = psutil.Process(os.getpid() if pid is None else pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in found:
        if not _is_zombie(p):
            continue
        try:
            ppid = p.ppid()
        except psutil.NoSuchProcess:  # reaped meanwhile
            continue
        try:
            parent = name(psutil.Process(ppid))
        except psutil.NoSuchProcess:
            parent = None
        out.append(Unreaped(p.pid, name(p) or "?", ppid, parent or "?"))
    return out
