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
import functools
import json
import os
import subprocess
import threading
from collections.abc import Iterator

from arpo_base.errors import ArpoError, ConfigError
from arpo_env.tools.sandbox_uids import (  # noqa: F401 - re-exported: the sandbox's public names
    POOL_SIZE,
    RUNTIME_DIR,
    CallCgroup,
    SandboxError,
    UidLeases,
    call_cgroups_available,
    check_uid_base,
    kill_uid,
    private_runtime_dir,
    uid_pool,
)

# Runs inside the child before the user code. argv[1] is a JSON config; the code arrives on stdin. Once the sandbox
# is set up, the bootstrap writes READY to stdout before anything else: a run whose stdout does not start with it
# failed in the sandbox itself (bwrap, setarch, the interpreter or this setup), never in the model's code, which
# cannot write before it. Exit code 121: the setup failed as requested (never a silent fallback).
READY = b"\x00arpo-sandbox-ready\n"
# SETUP is the part every backend and mode shares (limits, namespaces, uid); BOOTSTRAP adds the one-shot run.
SETUP = r"""
import ast, ctypes, json, os, resource, socket, sys, traceback
cfg = json.loads(sys.argv[1]); sys.argv = ["-c"]
if cfg.get("persistent"):  # a persistent interpreter: its calls arrive on its control socket
    src = None
elif cfg["code_file"]:
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
""".replace("READY", repr(READY))
BOOTSTRAP = (
    SETUP
    + r"""
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
)

_BACKENDS = ("auto", "subprocess", "bwrap", "docker")
_MAX_SANDBOXES = threading.BoundedSemaphore(max(4, 2 * (os.cpu_count() or 1)))


def sandbox_slot() -> threading.BoundedSemaphore:
    """The semaphore a call holds while its sandbox runs (see :func:`set_max_concurrency`)."""
    return _MAX_SANDBOXES


def set_max_concurrency(n: int) -> None:
    """Bound how many sandboxes run at once in this process, across all ``PythonTool`` instances and threads."""
    global _MAX_SANDBOXES
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"max concurrency must be a positive integer, got {n!r}")
    _MAX_SANDBOXES = threading.BoundedSemaphore(n)


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
_PATHS_SCRIPT = (
    "import json, os, site, sys\n"
    "print(json.dumps([os.path.realpath(sys.executable), sys.prefix, sys.exec_prefix, sys.base_prefix,"
    " sys.base_exec_prefix, *site.getsitepackages()]))"
)


@functools.lru_cache(maxsize=16)
def interpreter_paths(executable: str) -> tuple[str, ...]:
    """The folders ``executable`` needs, resolved: its prefixes and site folders and the folders of the command and of
    its resolved binary; nested ones dropped. Asked of the interpreter itself (a venv knows its base)."""
    try:
        proc = subprocess.run(
            [executable, "-I", "-c", _PATHS_SCRIPT],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env("/"),
            cwd="/",
        )
    except OSError as exc:
        raise SandboxError(
            f"cannot run the python tool's interpreter {executable}: {exc}",
            hint="set tools.python.python_executable to an existing interpreter",
        ) from exc
    if proc.returncode != 0:
        raise SandboxError(
            f"the python tool's interpreter {executable} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}",
            hint="check tools.python.python_executable",
        )
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
        return (
            "--disable-userns" in subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=30).stdout
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def bwrap_prefix(scratch: str, python_paths: tuple[str, ...], disk_mb: int = 64) -> list[str]:
    """bwrap's command line: an explicit list of read-only mounts instead of the host's ``/``.

    The interpreter's folders are bound after the private ``/tmp`` so an environment under ``/tmp`` reappears. As
    root there is no user namespace (it would map the code to host root; the bootstrap drops to the sandbox uid).
    The writable folders (``/tmp``, ``/dev/shm``, the scratch folder) are tmpfs of ``disk_mb`` each."""
    size = str(disk_mb << 20)
    args = [
        "bwrap",
        "--die-with-parent",
        "--new-session",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
    ]
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
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "01777",
        "--size",
        size,
        "--tmpfs",
        "/dev/shm",
        "--perms",
        "01777",
        "--size",
        size,
        "--tmpfs",
        "/tmp",
    ]
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
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LC_ALL": "C.UTF-8",
        "HOME": scratch,
        "TMPDIR": scratch,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
