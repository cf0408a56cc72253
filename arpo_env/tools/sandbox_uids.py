"""The sandbox's per-call resources: the pool of unprivileged uids a root server runs calls as (its locks in a
runtime folder no other user controls) and the per-call cgroup that caps a call's memory and processes together.

Split from :mod:`arpo_env.tools.sandbox`, which re-exports every name here.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import signal
import stat
import threading
import time

from arpo_base.errors import ArpoError, ConfigError

_UID_POOLS: dict[int, UidLeases] = {}
_UID_POOLS_LOCK = threading.Lock()


#: Where root keeps the uid pool's locks: a folder no other user can create first, replace or write into.
RUNTIME_DIR = "/run/arpo"


def private_runtime_dir(path: str = RUNTIME_DIR) -> int:
    """Open (creating it 0700 where missing) the folder ``path``, owned by this user, and return its descriptor.

    Every folder on the way, from ``/``, must be a real folder (no symbolic link) owned by root or this user and
    writable by no one else (or sticky, as ``/tmp``, where others cannot rename or remove what is not theirs), and
    ``path`` itself this user's and private (no access for group or others): otherwise another local user could have
    created or replaced it, and SandboxError refuses it."""
    parts = [p for p in os.path.abspath(path).split("/") if p]
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if last:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:  # ELOOP / ENOTDIR: a symbolic link or a file planted in its place
                raise SandboxError(
                    f"the sandbox's runtime folder {path}: {'/' + '/'.join(parts[: i + 1])} is not a "
                    f"folder ({exc.strerror})",
                    hint=f"remove it; {path} is made by the server",
                ) from exc
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            bad = (
                st.st_uid not in (0, os.geteuid())
                or (st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and not last))
                or (last and (st.st_uid != os.geteuid() or st.st_mode & 0o077))
            )
            if bad:
                raise SandboxError(
                    f"the sandbox's runtime folder {path}: {'/' + '/'.join(parts[: i + 1])} is owned by "
                    f"uid {st.st_uid} with mode {st.st_mode & 0o7777:04o}; it must be "
                    + (
                        "this user's own and private (0700)"
                        if last
                        else "root's or this user's and writable by no one else, or sticky"
                    ),
                    hint="another local user may have created it first: remove it and restart",
                )
        return fd
    except BaseException:
        os.close(fd)
        raise


class UidLeases:
    """Per-call sandbox uids leased across PROCESSES, not only threads.

    Each lease is an exclusive ``flock`` on ``<runtime_dir>/sandbox-uids/<uid>.lock``, so two processes on one host
    (the trainer, Ray rollout actors, a Serve replica, an eval run) never run sandboxes under the same uid at once;
    that matters because a finished call SIGKILLs every process of its uid. The folders are checked by
    :func:`private_runtime_dir` (no other user can hold the locks or redirect them) and the lock files are opened
    without following links. The kernel drops a dead process's locks, so a crash leaks nothing. ``get()`` waits (up
    to ``timeout_s``) when every uid is leased.
    """

    def __init__(self, uid_base: int, size: int = 256, timeout_s: float = 60.0, runtime_dir: str = RUNTIME_DIR) -> None:
        self.uids = range(check_uid_base(uid_base), uid_base + size)
        self.timeout_s = timeout_s
        self._held: dict[int, int] = {}  # uid -> lock fd
        # Round robin from a per-process offset: a uid just released may still count dying processes against its
        # RLIMIT_NPROC, so the next call takes another one (as a FIFO pool would).
        self._next = os.getpid() % size
        self._lock = threading.Lock()
        self.path = os.path.join(runtime_dir, "sandbox-uids")
        private_runtime_dir(runtime_dir)  # checks the parent the same way
        self._dir_fd = private_runtime_dir(self.path)

    def get(self) -> int:
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._lock:
                n = len(self.uids)
                for i in range(n):
                    uid = self.uids[(self._next + i) % n]
                    if uid in self._held:
                        continue
                    fd = self._open_lock(uid)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        os.close(fd)
                        continue
                    self._held[uid] = fd
                    self._next = (self._next + i + 1) % n
                    return uid
            if time.monotonic() > deadline:
                raise ArpoError(
                    f"no free sandbox uid in {self.uids.start}..{self.uids.stop - 1} after {self.timeout_s:g} s",
                    hint="fewer concurrent Python tool calls on this host",
                )
            time.sleep(0.02)

    def _open_lock(self, uid: int) -> int:
        try:
            fd = os.open(
                f"{uid}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._dir_fd
            )
        except OSError as exc:  # ELOOP: a symbolic link in place of the lock file
            raise SandboxError(
                f"the sandbox uid lock {self.path}/{uid}.lock cannot be opened safely: {exc.strerror}",
                hint=f"remove {self.path}; it is made by the server",
            ) from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise SandboxError(
                f"the sandbox uid lock {self.path}/{uid}.lock is not this user's regular file",
                hint=f"remove {self.path}; it is made by the server",
            )
        return fd

    def put(self, uid: int) -> None:
        with self._lock:
            fd = self._held.pop(uid, None)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


#: Uids in the pool per base; the pool's first uid is at least this (below it are the host's own system users).
POOL_SIZE = 256
MIN_UID_BASE = 10_000


def check_uid_base(uid_base: object) -> int:
    """``uid_base`` if every uid of its pool is free to hand out, else :class:`ConfigError`.

    Invariant: a finished call SIGKILLs every process of its uid, so no uid of the pool may belong to anyone (root,
    a system service, a login user): the pool starts at :data:`MIN_UID_BASE` and holds no uid the user database
    names."""
    import pwd

    if isinstance(uid_base, bool) or not isinstance(uid_base, int):
        raise ConfigError(f"python tool setting 'uid_base' must be an integer uid, got {uid_base!r}")
    if not MIN_UID_BASE <= uid_base <= 2**31 - 1 - POOL_SIZE:
        raise ConfigError(
            f"python tool setting 'uid_base' = {uid_base} is outside {MIN_UID_BASE}.."
            f"{2**31 - 1 - POOL_SIZE}: each call runs as a uid of [uid_base, uid_base + {POOL_SIZE}) and "
            "every process of that uid is killed when the call ends",
            hint="leave the default (62000)",
        )
    named = sorted(u.pw_uid for u in pwd.getpwall() if uid_base <= u.pw_uid < uid_base + POOL_SIZE)
    if named:
        raise ConfigError(
            f"python tool setting 'uid_base' = {uid_base}: its pool holds uid {named[0]} "
            f"({pwd.getpwuid(named[0]).pw_name}), a user of this host whose processes a finished call "
            "would kill",
            hint=f"choose a range of {POOL_SIZE} uids no user has",
        )
    return uid_base


def uid_pool(uid_base: int) -> UidLeases:
    """This process's lease book for the uid range starting at ``uid_base`` (one per base)."""
    with _UID_POOLS_LOCK:
        if uid_base not in _UID_POOLS:
            _UID_POOLS[uid_base] = UidLeases(uid_base)
        return _UID_POOLS[uid_base]


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (catches daemons and children that left the process group)."""
    for _ in range(20):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                # /proc/<pid>/status, not the directory owner: a process that changed uid is non-dumpable and its
                # /proc directory is owned by root.
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if line[:4] in ("Stat", "Uid:"))
                if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith(("Z", "X")):
                    found = True
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, KeyError, ValueError):
                continue
        if not found:
            return
        time.sleep(0.01)


class SandboxError(ArpoError):
    """The sandbox itself failed (setup, bwrap, setarch, the interpreter, the container engine): raised to the
    caller, never returned as an observation, since the model's code is not what failed."""


def _cgroup_v1_parents() -> dict[str, str] | None:
    """``{"memory": folder, "pids": folder}``: where this process's per-call groups go (``arpo-sandbox`` under its
    own group of each cgroup v1 hierarchy), or None without both v1 controllers. cgroup v2 is not used: its rule
    that a group with processes has no controlled children needs a delegated subtree this process cannot assume."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "cgroup":
                for c in set(fields[3].split(",")) & {"memory", "pids"}:
                    mounts[c] = fields[1]
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(","):
                own[c] = path
    if not {"memory", "pids"} <= set(mounts) or not {"memory", "pids"} <= set(own):
        return None
    return {c: os.path.join(mounts[c], own[c].lstrip("/"), "arpo-sandbox") for c in ("memory", "pids")}


@functools.lru_cache(maxsize=1)
def call_cgroups_available() -> bool:
    """Whether calls get a cgroup each (root, cgroup v1 memory and pids controllers writable here)."""
    if os.geteuid() != 0:
        return False
    try:
        parents = _cgroup_v1_parents()
        if parents is None:
            return False
        for path in parents.values():
            os.makedirs(path, exist_ok=True)
        return True
    except OSError:
        return False


class CallCgroup:
    """One call's cgroup v1 memory and pids groups (named by its leased uid, so unique on the host): the memory
    limit counts every process of the call and the tmpfs pages it writes, ``pids.max`` every process and thread.
    Joined by a shell in front of the sandbox's command line, before anything of the call runs."""

    def __init__(self, uid: int, memory_bytes: int, max_procs: int) -> None:
        parents = _cgroup_v1_parents()
        if parents is None:
            raise SandboxError("the cgroup v1 memory and pids controllers are gone", hint="run `arpo doctor`")
        self.paths = {c: os.path.join(p, str(uid)) for c, p in parents.items()}
        try:
            for path in self.paths.values():
                if os.path.isdir(path):  # a crashed server's leftover: its processes die, its limits are reset
                    self._empty(path)
                os.mkdir(path)
            mem = self.paths["memory"]
            self._write(os.path.join(mem, "memory.limit_in_bytes"), memory_bytes)
            if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):  # no swap beyond the limit
                self._write(os.path.join(mem, "memory.memsw.limit_in_bytes"), memory_bytes)
            self._write(os.path.join(self.paths["pids"], "pids.max"), max_procs)
        except OSError as exc:
            self.close()
            raise SandboxError(f"cannot set up the call's cgroup: {exc}", hint="run `arpo doctor`") from exc

    @staticmethod
    def _write(path: str, value: int) -> None:
        with open(path, "w") as f:
            f.write(str(value))

    def join_prefix(self) -> list[str]:
        """A command line prefix that moves itself into both groups, then runs the rest."""
        return [
            "/bin/sh",
            "-c",
            'echo $$ > "$1" && echo $$ > "$2" && shift 2 && exec "$@"',
            "arpo-sandbox-join",
            os.path.join(self.paths["memory"], "cgroup.procs"),
            os.path.join(self.paths["pids"], "cgroup.procs"),
        ]

    @staticmethod
    def _empty(path: str) -> None:
        for _ in range(200):
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
            except FileNotFoundError:
                return
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
        for _ in range(200):
            try:
                os.rmdir(path)
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY while the last processes exit
                time.sleep(0.005)

    def close(self) -> None:
        """Kill what is left in the groups and remove them."""
        for path in self.paths.values():
            self._empty(path)
