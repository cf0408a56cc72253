"""The Python tool's sandbox: the bootstrap script that runs inside the child, its limits, the per-call uid pool and
the command line of each backend (used by :class:`arpo_env.tools.python_tool.PythonTool`).

Every backend applies the same limits inside the child: a wall-clock timeout that kills the process group and every
process of the call's sandbox uid, ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE`` (one file's size), ``RLIMIT_CORE=0``
and an output cap (a process that writes more than ``max(1 MiB, 16 x max_output_chars)`` bytes is stopped).

Isolation per backend (the tool measures what it gets in its self-test, see :mod:`arpo_env.tools.isolation`):

* ``subprocess`` as root (containers, CI): the child enters a new network namespace (only a loopback device that is
  down: even 127.0.0.1 is unreachable) and a mount namespace, then runs under a per-call unprivileged uid drawn from
  a pool, with no capabilities and ``no_new_privs``. It cannot signal host processes, read root-only files or other
  processes' environments, or write root-owned places, and ``RLIMIT_NPROC`` (never enforced for root) stops fork
  bombs. When the interpreter lives under a folder others cannot enter (a 0700 home), the mount namespace covers
  that folder with an empty one that holds only the interpreter's own folders, so the uid can run it without any
  capability to read what root reads. ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/run/lock`` are private, and its
  ``/proc`` (``hidepid=2``) shows only its own processes. It still reads world-readable host files: level
  ``process``.
* ``subprocess`` as another user: a user and network namespace when the kernel allows them; the code runs as that
  user, so it reads and signals what the user can: level ``unisolated``.
* ``bwrap``: a new root filesystem holding only what the interpreter needs, read-only (``/usr``, the ``/lib*`` links,
  the loader's ``/etc/ld.so.*``, the interpreter, ``sys.base_prefix``, the environment's prefix and site folders,
  wherever they live, ``/tmp`` included: they are bound after the private ``/tmp``), a private ``/tmp`` and
  ``/dev/shm``, the scratch folder read-write, fresh ``/proc`` and ``/dev``, and PID, network, IPC and UTS
  namespaces. As root it runs without a user namespace (which would map the code to host root) and the bootstrap
  drops to the per-call uid; as another user bwrap adds a user namespace. Level ``filesystem``.
* ``docker``: a container as ``nobody`` with no network, no capability, ``no-new-privileges``, a read-only root, a
  memory and a PID limit and sized private tmpfs (:mod:`arpo_env.tools.sandbox_docker`): level ``filesystem``.

A caller can cut calls short: while :func:`cancel_scope` holds a set event for the calling thread, a running call's
process group and uid are killed at once (within the collector's 0.1 s poll) and :class:`ToolCancelled` is raised
instead of a result (the server uses it for a request whose deadline passed).

Bounded as well: the writable folders are sized tmpfs (bwrap, subprocess as root), a call's processes share one
memory and process cap where cgroup v1 offers it (:class:`CallCgroup`), and a seccomp filter forbids new user
namespaces. Not covered: kernel exploits.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator

from arpo_base.errors import ArpoError, ConfigError

# Runs inside the child before the user code. argv[1] is a JSON config; the code arrives on stdin. Once the sandbox
# is set up, the bootstrap writes READY to stdout before anything else: a run whose stdout does not start with it
# failed in the sandbox itself (bwrap, setarch, the interpreter or this setup), never in the model's code, which
# cannot write before it. Exit code 121: the setup failed as requested (never a silent fallback).
READY = b"\x00arpo-sandbox-ready\n"
BOOTSTRAP = r"""
import ast, ctypes, json, os, resource, socket, sys, traceback
cfg = json.loads(sys.argv[1]); sys.argv = ["-c"]
if cfg["code_file"]:
    with open(cfg["code_file"], encoding="utf-8") as f: src = f.read()
else:
    src = sys.stdin.buffer.read().decode("utf-8", "replace")
fd = os.open(os.devnull, os.O_RDONLY); os.dup2(fd, 0); os.close(fd)
sys.stdout.reconfigure(line_buffering=True)
libc = ctypes.CDLL(None, use_errno=True)
def fail(msg):
    sys.stderr.write("sandbox setup failed: " + msg + "\n"); sys.stderr.flush(); os._exit(121)
def check(rc, what):
    if rc != 0: fail("%s: %s" % (what, os.strerror(ctypes.get_errno())))
def mounts(expose, private, keep):
    # In a mount namespace of its own: the folders anyone may write (/tmp, ...) are replaced by empty ones, and a
    # folder others cannot enter (e.g. a 0700 home holding the interpreter) by an empty one holding only what the
    # sandbox uid must reach (the interpreter's folders, the scratch folder), bound back from descriptors opened
    # before any cover.
    check(libc.mount(b"none", b"/", None, 16384 | 262144, None), "mount --make-rprivate /")
    covers = {d: (b"mode=1777", []) for d in private if os.path.isdir(d) and not os.path.islink(d)}
    for p in expose + keep:
        top = next((d for d in covers if p.startswith(d + "/")), None)
        cur = ""
        for part in ([] if top else p.strip("/").split("/")[:-1]):
            cur += "/" + part
            if not os.stat(cur).st_mode & 0o001:
                top = cur; covers[cur] = (b"mode=0755", []); break
        if top:
            covers[top][1].append((p, os.open(p, os.O_PATH)))
    for top, (mode, inner) in covers.items():
        # The private folders are sized: what the code writes there is memory the rlimits would not count.
        opts = mode + (b",size=%dk" % cfg["disk_kb"] if top in private else b"")
        check(libc.mount(b"tmpfs", top.encode(), b"tmpfs", 2 | 4, opts), "mount tmpfs on " + top)
        for p, fd in inner:
            os.makedirs(p, exist_ok=True)
            check(libc.mount(("/proc/self/fd/%d" % fd).encode(), p.encode(), None, 4096 | 16384, None), "bind " + p)
            os.close(fd)
    # The scratch folder (keep[0]) becomes a sized tmpfs of the sandbox uid: the code's whole disk is bounded.
    os.makedirs(keep[0], exist_ok=True)
    check(libc.mount(b"tmpfs", keep[0].encode(), b"tmpfs", 2 | 4, b"mode=0700,uid=%d,gid=%d,size=%dk"
                     % (cfg["uid"], cfg["uid"], cfg["disk_kb"])), "mount tmpfs on " + keep[0])
    # A /proc of its own that shows only the sandbox uid's processes (hidepid): no other command line or status.
    check(libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, b"hidepid=2"), "mount proc on /proc (hidepid=2)")
    os.chdir(keep[0])
def no_userns():
    # A seccomp filter: unshare() and clone() with CLONE_NEWUSER fail with EPERM, clone3() with ENOSYS (its flags
    # live in memory a filter cannot read; the C library then falls back to clone()), and a foreign system-call ABI
    # (32-bit, x32) fails as a whole, so no path to a new user namespace is left.
    import platform, struct
    arch = {"x86_64": (0xC000003E, 272, 56), "aarch64": (0xC00000B7, 97, 220)}.get(platform.machine())
    if arch is None: fail("no user-namespace filter for the architecture " + platform.machine())
    audit, nr_unshare, nr_clone = arch
    ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x50000 | 1, 0x50000 | 38
    prog = [(0x20, 0, 0, 4), (0x15, 1, 0, audit), (0x06, 0, 0, EPERM), (0x20, 0, 0, 0),
            (0x35, 0, 1, 0x40000000), (0x06, 0, 0, EPERM), (0x15, 0, 1, 435), (0x06, 0, 0, ENOSYS),
            (0x15, 1, 0, nr_unshare), (0x15, 0, 3, nr_clone), (0x20, 0, 0, 16), (0x45, 0, 1, 0x10000000),
            (0x06, 0, 0, EPERM), (0x06, 0, 0, ALLOW)]
    buf = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *ins) for ins in prog))
    fprog = struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(buf))
    check(libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    check(libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0), "prctl(PR_SET_SECCOMP) user-namespace filter")
flags = (0x40000000 if cfg["net"] else 0) | (0x20000 if cfg["mounts"] else 0)
if flags:
    flags |= 0 if os.geteuid() == 0 else 0x10000000
    check(libc.unshare(flags), "unshare(%#x)" % flags)
if cfg["mounts"]:
    mounts(**cfg["mounts"])
if cfg["uid"] is not None:
    if cfg["own_dir"]:  # bwrap's sized scratch tmpfs, made by root: handed to the sandbox uid
        os.chown(cfg["own_dir"], cfg["uid"], cfg["uid"])
    # From uid 0 to the sandbox uid without PR_SET_KEEPCAPS: every capability is dropped with it.
    os.setgroups([]); os.setgid(cfg["uid"]); os.setuid(cfg["uid"])
    with open("/proc/self/status") as f:
        if any(l.startswith("CapEff:") and int(l.split()[1], 16) for l in f): fail("capabilities left after setuid")
if cfg["no_userns"]:
    no_userns()
for name, value in cfg["limits"].items():
    lim = getattr(resource, name)
    hard = resource.getrlimit(lim)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    # RLIMIT_CPU: the soft limit sends SIGXCPU (a clear message), the hard one a second later SIGKILL.
    room = hard == resource.RLIM_INFINITY or value + 1 <= hard
    soft_hard = (value, value + 1) if name == "RLIMIT_CPU" and room else (value, value)
    resource.setrlimit(lim, soft_hard)
os.write(1, READY)
if cfg["probe"]:
    # The self-test's attempts, made with the rights the model's code gets: read each planted host file, connect to
    # the host's listener on 127.0.0.1. "read"/"connected" means the attempt succeeded; else the error's name.
    def attempt(fn):
        try: return fn()
        except OSError as exc: return type(exc).__name__
    def read(path):
        with open(path) as f: return "read" if f.read() == cfg["probe"]["token"] else "read (other content)"
    def connect(port):
        s = socket.create_connection(("127.0.0.1", port), timeout=2); s.close(); return "connected"
    def userns():
        for name in ("uid_map", "gid_map"):
            with open("/proc/self/" + name) as f:
                if not f.read().strip(): return "unmapped"  # a user namespace whose uid the host does not know
        return "mapped"
    res = {name: attempt(lambda p=path: read(p)) for name, path in cfg["probe"]["files"].items()}
    res["connect to the host's 127.0.0.1"] = attempt(lambda: connect(cfg["probe"]["port"]))
    res["create a user namespace"] = "created" if libc.unshare(0x10000000) == 0 else os.strerror(ctypes.get_errno())
    print(json.dumps({"uid": os.getuid(), "ifaces": sorted(n for _, n in socket.if_nameindex()),
                      "userns": attempt(userns), "attempts": res})); sys.exit(0)
""".replace("READY", repr(READY)) + r"""
def _main(src, echo):
    try:
        tree = ast.parse(src, "<string>")
        last = tree.body[-1] if tree.body else None
        if echo and isinstance(last, ast.Expr) and not (isinstance(last.value, ast.Call)
                and isinstance(last.value.func, ast.Name) and last.value.func.id == "print"):
            call = ast.Call(ast.Name("print", ast.Load()), [last.value], [])
            tree.body[-1] = ast.copy_location(ast.Expr(call), last)
            ast.fix_missing_locations(tree)
        code = compile(tree, "<string>", "exec")
    except SyntaxError as exc:
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc))); sys.exit(1)
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next); sys.exit(1)
_main(src, cfg["echo"])
"""

_BACKENDS = ("auto", "subprocess", "bwrap", "docker")
_MAX_SANDBOXES = threading.BoundedSemaphore(max(4, 2 * (os.cpu_count() or 1)))
_UID_POOLS: dict[int, UidLeases] = {}
_UID_POOLS_LOCK = threading.Lock()


def sandbox_slot() -> threading.BoundedSemaphore:
    """The semaphore a call holds while its sandbox runs (see :func:`set_max_concurrency`)."""
    return _MAX_SANDBOXES


def set_max_concurrency(n: int) -> None:
    """Bound how many sandboxes run at once in this process, across all ``PythonTool`` instances and threads."""
    global _MAX_SANDBOXES
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"max concurrency must be a positive integer, got {n!r}")
    _MAX_SANDBOXES = threading.BoundedSemaphore(n)


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
                raise SandboxError(f"the sandbox's runtime folder {path}: {'/' + '/'.join(parts[:i + 1])} is not a "
                                   f"folder ({exc.strerror})", hint=f"remove it; {path} is made by the server") \
                    from exc
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            bad = (st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and
                                                                                      not last))
                   or (last and (st.st_uid != os.geteuid() or st.st_mode & 0o077)))
            if bad:
                raise SandboxError(f"the sandbox's runtime folder {path}: {'/' + '/'.join(parts[:i + 1])} is owned by "
                                   f"uid {st.st_uid} with mode {st.st_mode & 0o7777:04o}; it must be "
                                   + ("this user's own and private (0700)" if last else
                                      "root's or this user's and writable by no one else, or sticky"),
                                   hint="another local user may have created it first: remove it and restart")
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

    def __init__(self, uid_base: int, size: int = 256, timeout_s: float = 60.0,
                 runtime_dir: str = RUNTIME_DIR) -> None:
        self.uids = range(uid_base, uid_base + size)
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
                raise ArpoError(f"no free sandbox uid in {self.uids.start}..{self.uids.stop - 1} after "
                                f"{self.timeout_s:g} s", hint="fewer concurrent Python tool calls on this host")
            time.sleep(0.02)

    def _open_lock(self, uid: int) -> int:
        try:
            fd = os.open(f"{uid}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self._dir_fd)
        except OSError as exc:  # ELOOP: a symbolic link in place of the lock file
            raise SandboxError(f"the sandbox uid lock {self.path}/{uid}.lock cannot be opened safely: {exc.strerror}",
                               hint=f"remove {self.path}; it is made by the server") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise SandboxError(f"the sandbox uid lock {self.path}/{uid}.lock is not this user's regular file",
                               hint=f"remove {self.path}; it is made by the server")
        return fd

    def put(self, uid: int) -> None:
        with self._lock:
            fd = self._held.pop(uid, None)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


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
        return ["/bin/sh", "-c", 'echo $$ > "$1" && echo $$ > "$2" && shift 2 && exec "$@"', "arpo-sandbox-join",
                os.path.join(self.paths["memory"], "cgroup.procs"), os.path.join(self.paths["pids"], "cgroup.procs")]

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


class ToolCancelled(ArpoError):
    """The caller cancelled the call (see :func:`cancel_scope`); its process is already killed. Raised, never an
    observation: the code did not fail, nobody waits for its result."""


_CANCEL = threading.local()


@contextlib.contextmanager
def cancel_scope(event: threading.Event | None) -> Iterator[None]:
    """While open, tool calls made by THIS thread end as soon as ``event`` is set: the sandboxed process (its group
    and its uid) is killed and :class:`ToolCancelled` raised. Scopes nest; the previous one comes back on exit."""
    previous = getattr(_CANCEL, "event", None)
    _CANCEL.event = event
    try:
        yield
    finally:
        _CANCEL.event = previous


def cancel_event() -> threading.Event | None:
    """The event of the calling thread's innermost :func:`cancel_scope` (None outside any)."""
    return getattr(_CANCEL, "event", None)


# Folders anyone may write on a usual host: the subprocess backend's mount namespace replaces them by private ones.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# Read-only system folders the dynamic loader and the interpreter need; symlinks (merged /usr) stay symlinks.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_LOADER_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
_PATHS_SCRIPT = ("import json, os, site, sys\n"
                 "print(json.dumps([os.path.realpath(sys.executable), sys.prefix, sys.exec_prefix, sys.base_prefix,"
                 " sys.base_exec_prefix, *site.getsitepackages()]))")


@functools.lru_cache(maxsize=16)
def interpreter_paths(executable: str) -> tuple[str, ...]:
    """The folders ``executable`` needs, resolved: its prefixes and site folders and the folders of the command and of
    its resolved binary; nested ones dropped. Asked of the interpreter itself (a venv knows its base)."""
    try:
        proc = subprocess.run([executable, "-I", "-c", _PATHS_SCRIPT], capture_output=True, text=True, timeout=60,
                              env=child_env("/"), cwd="/")
    except OSError as exc:
        raise SandboxError(f"cannot run the python tool's interpreter {executable}: {exc}",
                           hint="set tools.python.python_executable to an existing interpreter") from exc
    if proc.returncode != 0:
        raise SandboxError(f"the python tool's interpreter {executable} failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-500:]}", hint="check tools.python.python_executable")
    real_exe, *dirs = json.loads(proc.stdout)
    dirs += [os.path.dirname(real_exe), os.path.dirname(os.path.abspath(executable))]
    found = sorted({os.path.realpath(d) for d in dirs if os.path.isdir(d)})
    kept: list[str] = []
    for d in found:  # sorted: a parent comes before what it contains
        if not any(d == k or d.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(d)
    return tuple(kept)


@functools.lru_cache(maxsize=1)
def bwrap_disables_userns() -> bool:
    """Whether the installed bwrap has ``--disable-userns`` (bubblewrap 0.8 and later)."""
    try:
        return "--disable-userns" in subprocess.run(["bwrap", "--help"], capture_output=True, text=True,
                                                    timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


def bwrap_prefix(scratch: str, python_paths: tuple[str, ...], disk_mb: int = 64) -> list[str]:
    """bwrap's command line: an explicit list of read-only mounts instead of the host's ``/``.

    The interpreter's folders are bound after the private ``/tmp`` so an environment under ``/tmp`` reappears. As
    root there is no user namespace (it would map the code to host root; the bootstrap drops to the sandbox uid).
    The writable folders (``/tmp``, ``/dev/shm``, the scratch folder) are tmpfs of ``disk_mb`` each."""
    size = str(disk_mb << 20)
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
            "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() != 0:
        args.append("--unshare-user")
        if bwrap_disables_userns():  # besides the bootstrap's seccomp filter
            args.append("--disable-userns")
    system = []
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
            system.append(d)
    for f in _LOADER_FILES:
        args += ["--ro-bind-try", f, f]
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "01777", "--size", size, "--tmpfs", "/dev/shm",
             "--perms", "01777", "--size", size, "--tmpfs", "/tmp"]
    made = {"/", "/tmp", "/dev", "/dev/shm", "/proc"}

    def parents(path: str) -> list[str]:
        # bwrap would create missing parents 0700 as root: the sandbox uid could not enter them.
        out, cur = [], ""
        for part in path.strip("/").split("/")[:-1]:
            cur += "/" + part
            if cur not in made:
                made.add(cur)
                out += ["--perms", "0755", "--dir", cur]
        return out

    for p in python_paths:
        if not any(p == s or p.startswith(s + "/") for s in system):
            args += [*parents(p), "--ro-bind", p, p]
    # The scratch folder is a sized tmpfs (as root the bootstrap hands it to the sandbox uid before dropping).
    return [*args, *parents(scratch), "--perms", "0700", "--size", size, "--tmpfs", scratch, "--chdir", scratch, "--"]


def child_env(scratch: str) -> dict[str, str]:
    # Nothing is inherited from the host; thread counts are pinned so numeric libraries fit the memory limit.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch,
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
