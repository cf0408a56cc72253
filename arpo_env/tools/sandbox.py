"""The Python tool's sandbox: the bootstrap script that runs inside the child, its limits, the per-call uid pool,
the backends and their capability probe (used by :class:`arpo_env.tools.python_tool.PythonTool`).

What the ``subprocess`` backend protects against:

* Runaway time: a wall-clock timeout kills the whole process group and every process of the call's sandbox uid;
  ``RLIMIT_CPU`` stops CPU burners. Messages are in English.
* Memory bombs (``RLIMIT_AS``), single huge files (``RLIMIT_FSIZE``; Python then raises ``OSError: File too large``),
  output floods (stdout/stderr are read incrementally, capped with a visible marker, and a process that writes
  more than ``max(1 MiB, 16 x max_output_chars)`` bytes is stopped), core dumps (``RLIMIT_CORE=0``).
* Network: when the kernel allows it, the child enters a new network namespace (``unshare(CLONE_NEWNET)``; as a
  non-root user together with ``CLONE_NEWUSER``), so it has only a loopback device that is down; even connections
  to 127.0.0.1 fail. ``sandbox_capabilities()`` and ``ToolResult.meta["network_isolated"]`` say whether it holds.
* When the host runs as root (containers, CI): the code runs under a per-call unprivileged uid drawn from a pool
  (``uid_base`` ...), with ``no_new_privs``. So it cannot signal host processes (killing the parent fails with
  EPERM), cannot write root-owned files (only world-writable places such as ``/tmp`` and its scratch directory),
  and ``RLIMIT_NPROC`` is enforced (the kernel never enforces it for uid 0), which stops fork bombs. It keeps
  ``CAP_DAC_READ_SEARCH`` only, so it can still *read* files that root can read: needed because the interpreter
  often lives under ``/root`` (0700).
* A fresh scratch directory is the working directory and is removed afterwards.

What it does NOT protect against: reading host files (no filesystem isolation; use ``backend="bwrap"`` or
``"docker"``), filling the disk with many files (only the size of each file is capped), kernel exploits, and -- when
the host does not run as root -- signalling other processes of the same user (killing the parent) and fork bombs
(``RLIMIT_NPROC`` then counts all processes of that user). Concurrent sandboxes draw distinct uids, so they cannot
signal each other either. The ``bwrap`` backend adds a read-only root filesystem, private ``/tmp``, and PID,
network and IPC namespaces; the ``docker`` backend (docker SDK, imported lazily) runs in a container with no
network, a memory and a PID limit.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from arpo_base.errors import ArpoError, ConfigError

# Runs inside the child before the user code. argv[1] is a JSON config; the code arrives on stdin.
# Exit code 121 means the sandbox could not be set up as requested (never a silent fallback).
BOOTSTRAP = r"""
import ast, ctypes, json, os, resource, sys, traceback
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
if cfg["net"]:
    flags = 0x40000000 | (0 if os.geteuid() == 0 else 0x10000000)
    if libc.unshare(flags) != 0: fail("unshare(CLONE_NEWNET) errno %d" % ctypes.get_errno())
if cfg["uid"] is not None:
    libc.prctl(8, 1, 0, 0, 0)
    os.setgroups([]); os.setgid(cfg["uid"]); os.setuid(cfg["uid"])
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)(4, 4, 4, 0, 0, 0)
    if libc.capset(hdr, data) != 0: fail("capset errno %d" % ctypes.get_errno())
    libc.prctl(47, 2, 2, 0, 0)
    if libc.prctl(38, 1, 0, 0, 0) != 0: fail("no_new_privs")
for name, value in cfg["limits"].items():
    lim = getattr(resource, name)
    hard = resource.getrlimit(lim)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    # RLIMIT_CPU: the soft limit sends SIGXCPU (a clear message), the hard one a second later SIGKILL.
    room = hard == resource.RLIM_INFINITY or value + 1 <= hard
    soft_hard = (value, value + 1) if name == "RLIMIT_CPU" and room else (value, value)
    resource.setrlimit(lim, soft_hard)
if cfg["probe"]:
    print(json.dumps({"uid": os.getuid(), "net": cfg["net"]})); sys.exit(0)
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
_CAPS: dict[str, dict] = {}
_CAPS_LOCK = threading.Lock()


def sandbox_slot() -> threading.BoundedSemaphore:
    """The semaphore a call holds while its sandbox runs (see :func:`set_max_concurrency`)."""
    return _MAX_SANDBOXES


def set_max_concurrency(n: int) -> None:
    """Bound how many sandboxes run at once in this process, across all ``PythonTool`` instances and threads."""
    global _MAX_SANDBOXES
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"max concurrency must be a positive integer, got {n!r}")
    _MAX_SANDBOXES = threading.BoundedSemaphore(n)


class UidLeases:
    """Per-call sandbox uids leased across PROCESSES, not only threads.

    Each lease is an exclusive ``flock`` on ``<tmp>/arpo-sandbox-uids/<uid>.lock``, so two processes on one host (the
    trainer, Ray rollout actors, a Serve replica, an eval run) never run sandboxes under the same uid at once; that
    matters because a finished call SIGKILLs every process of its uid. The kernel drops a dead process's locks, so a
    crash leaks nothing. ``get()`` waits (up to ``timeout_s``) when every uid is leased.
    """

    def __init__(self, uid_base: int, size: int = 256, timeout_s: float = 60.0) -> None:
        self.uids = range(uid_base, uid_base + size)
        self.timeout_s = timeout_s
        self._held: dict[int, int] = {}  # uid -> lock fd
        # Round robin from a per-process offset: a uid just released may still count dying processes against its
        # RLIMIT_NPROC, so the next call takes another one (as a FIFO pool would).
        self._next = os.getpid() % size
        self._lock = threading.Lock()
        self._dir = os.path.join(tempfile.gettempdir(), "arpo-sandbox-uids")
        os.makedirs(self._dir, mode=0o700, exist_ok=True)

    def get(self) -> int:
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._lock:
                n = len(self.uids)
                for i in range(n):
                    uid = self.uids[(self._next + i) % n]
                    if uid in self._held:
                        continue
                    fd = os.open(os.path.join(self._dir, f"{uid}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
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


def sandbox_capabilities(backend: str = "auto") -> dict:
    """Probe (once per backend) what isolation this machine provides.

    Args:
        backend: ``"auto"``, ``"subprocess"``, ``"bwrap"`` or ``"docker"``.

    Returns:
        ``{"backend": resolved backend, "network_isolation": bool, "uid_drop": bool, "detail": str}``.
    """
    if backend not in _BACKENDS:
        raise ConfigError(f"unknown python sandbox backend {backend!r}; choose one of {_BACKENDS}")
    with _CAPS_LOCK:
        if backend not in _CAPS:
            _CAPS[backend] = _probe(backend)
        return dict(_CAPS[backend])


def _probe(backend: str) -> dict:
    if backend == "auto":
        backend = "bwrap" if shutil.which("bwrap") and _probe("bwrap")["available"] else "subprocess"
    if backend == "docker":
        return {"backend": "docker", "available": True, "network_isolation": True, "uid_drop": False,
                "detail": "docker container with network disabled (engine checked at first call)"}
    cmd_prefix = bwrap_prefix(tempfile.gettempdir()) if backend == "bwrap" else []
    if backend == "bwrap" and not shutil.which("bwrap"):
        return {"backend": "bwrap", "available": False, "network_isolation": False, "uid_drop": False,
                "detail": "bwrap is not installed"}
    results = {}
    combos = [(False, None)] if backend == "bwrap" else [(True, None), (False, _probe_uid())]
    for net, uid in combos:
        cfg = {"code_file": None, "net": net, "uid": uid, "limits": {}, "probe": True, "echo": False}
        proc = subprocess.run([*cmd_prefix, sys.executable, "-I", "-c", BOOTSTRAP, json.dumps(cfg)],
                              input=b"", capture_output=True, timeout=30, env=child_env("/"), cwd="/")
        results[(net, uid)] = proc.returncode == 0
    if backend == "bwrap" and not results[(False, None)]:
        return {"backend": "bwrap", "available": False, "network_isolation": False, "uid_drop": False,
                "detail": "bwrap is installed but cannot create namespaces here"}
    net_ok = backend == "bwrap" or results.get((True, None), False)
    uid_ok = any(ok for (_, uid), ok in results.items() if uid is not None)
    detail = (f"{backend}: network namespace {'available' if net_ok else 'NOT available'}; "
              f"per-call uid drop {'active' if uid_ok else 'inactive (host is not root)' if os.geteuid() else 'FAILED'}")
    return {"backend": backend, "available": True, "network_isolation": net_ok, "uid_drop": uid_ok, "detail": detail}


def _probe_uid() -> int | None:
    return 64_999 if os.geteuid() == 0 else None


def bwrap_prefix(scratch: str) -> list[str]:
    return ["bwrap", "--die-with-parent", "--unshare-all", "--new-session", "--ro-bind", "/", "/", "--dev", "/dev",
            "--proc", "/proc", "--tmpfs", "/tmp", "--bind", scratch, scratch, "--chdir", scratch, "--"]


def child_env(scratch: str) -> dict[str, str]:
    # Nothing is inherited from the host; thread counts are pinned so numeric libraries fit the memory limit.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch,
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
