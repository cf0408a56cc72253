"""The child side of a persistent interpreter: the loop that runs after the sandbox's :data:`SETUP` (limits, namespaces,
uid), inside the sandbox, fed by its host (:mod:`arpo_env.tools.interpreter`).

Protocol on the control socket (a Unix stream socket, fd ``cfg["persistent"]["fd"]``): each message is a 4-byte
big-endian length and a JSON object; a ``fork`` request carries three descriptors (the new branch's stdout and stderr
pipes and its control socket) as ``SCM_RIGHTS``. Requests and their one reply each:

* ``{"op": "run", "code": str}`` -> ``{"rc": int, "threads": int}`` once the code finished (``threads``: the
  threads still running besides the loop's, which makes the host end this interpreter); what it printed went to fds
  1 and 2, written before the reply, so the host holds all of it when the reply arrives.
* ``{"op": "fork", "fresh": bool, "seed": int | None}`` -> ``{"ok": true}`` or ``{"error": str}`` on this socket;
  the new branch then
  says ``{"pid": int}`` or ``{"error": str}`` on its own socket. A fork is a double fork (the branch is adopted by
  the sandbox's init, which reaps it) in which the branch becomes a process group of its own, copies the working
  folder (``fresh``: an empty one, a fresh namespace) and reopens, in its copy, every descriptor that pointed into
  the parent's folder, so no file offset or content is shared with a sibling.

Randomness. A fresh interpreter with a ``seed`` seeds ``random`` from it, and numpy's global generator (the one behind
``numpy.random.rand`` and friends) from it when the code first imports numpy; without a seed both draw from the OS. A
forked branch continues its parent's state: CPython re-seeds ``random`` from the OS in a forked child, so the loop
carries the parent's state across the fork and restores it; numpy's state is copied by the fork itself. A branch
therefore draws what its parent would have drawn next, so a fork equals a replay of the parent's calls, and sibling
branches draw the same numbers (each is that replay). Generators the code makes itself
(``numpy.random.default_rng()`` without a seed, ``random.SystemRandom``, ``os.urandom``) read the OS and are not
seeded.
* ``{"op": "kill", "pid": int}`` (to the root process only) -> ``{"ok": true}``: SIGKILL to that branch's group.

End of file on the socket (the host closed it, or died) ends the process at once. The host reads this socket as
hostile input (model code runs in this process and can write to it): a reply above 64 KiB, a wait past its total
deadline, bytes beyond the one reply, or a reply that is not one JSON object ends the interpreter.
The root process (the zygote) never runs code: it only forks fresh branches and kills them, and keeps the sandbox
(its PID namespace) alive while branches live.
"""

from __future__ import annotations

#: Appended to the sandbox's SETUP; ``cfg`` and ``libc`` are SETUP's names. Kept free of any import from arpo: it
#: runs inside the sandbox, which holds only the interpreter's own folders.
LOOP = r"""
import json as _json, socket as _socket, struct as _struct, shutil as _shutil, signal as _signal, stat as _stat
import time as _time
_P = cfg["persistent"]
_ns = {"__name__": "__main__", "__builtins__": __builtins__}
_ctl = _socket.socket(fileno=_P["fd"])
_home = None  # this branch's working folder (None in the zygote)
_CPU_HARD = resource.getrlimit(resource.RLIMIT_CPU)[1]
import random as _random

class _SeedNumpy:
    # First in sys.meta_path of a seeded interpreter until numpy is imported: seeds numpy's global generator right
    # after numpy's own import, before any code can draw from it (a branch inherits it while numpy is not imported).
    def __init__(self, seed): self.seed = seed
    def find_spec(self, name, path=None, target=None):
        if name != "numpy": return None
        import importlib.util as _iu
        if self in sys.meta_path: sys.meta_path.remove(self)
        spec = _iu.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"): return spec
        run, seed = spec.loader.exec_module, self.seed
        def exec_module(module):
            run(module)
            __import__("numpy.random").random.seed(seed)
        spec.loader.exec_module = exec_module
        return spec

def _seed(seed):
    _random.seed(seed)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _SeedNumpy)]
    if "numpy" in sys.modules: sys.modules["numpy"].random.seed(seed % 2**32)
    else: sys.meta_path.insert(0, _SeedNumpy(seed % 2**32))

def _recv():
    head, fds = b"", []
    while len(head) < 4:
        msg, got, _, _ = _socket.recv_fds(_ctl, 4 - len(head), 4)
        if not msg: os._exit(0)  # the host closed the socket: this branch's trajectory ended
        head += msg; fds += got
    n, body = _struct.unpack(">I", head)[0], b""
    while len(body) < n:
        chunk = _ctl.recv(n - len(body))
        if not chunk: os._exit(0)
        body += chunk
    return _json.loads(body), fds

def _send(sock, obj):
    data = _json.dumps(obj).encode()
    sock.sendall(_struct.pack(">I", len(data)) + data)

def _run(src):
    # Per call: the CPU limit is this call's share on top of what the interpreter already used.
    used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    soft = int(used) + _P["cpu_s"]
    if _CPU_HARD != resource.RLIM_INFINITY: soft = min(soft, _CPU_HARD - 1)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, _CPU_HARD))
    try:
        tree = ast.parse(src, "<string>")
        last = tree.body[-1] if tree.body else None
        if cfg["echo"] and isinstance(last, ast.Expr) and not (isinstance(last.value, ast.Call)
                and isinstance(last.value.func, ast.Name) and last.value.func.id == "print"):
            tree.body[-1] = ast.copy_location(ast.Expr(ast.Call(ast.Name("print", ast.Load()), [last.value], [])),
                                              last)
            ast.fix_missing_locations(tree)
        code = compile(tree, "<string>", "exec")
    except SyntaxError as exc:
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc))); return 1
    try:
        exec(code, _ns)
        return 0
    except SystemExit as exc:  # exit() ends the call with its status; the interpreter stays
        c = exc.code
        if c is not None and not isinstance(c, int): sys.stderr.write(str(c) + "\n")
        return c if isinstance(c, int) else (0 if c is None else 1)
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next); return 1
    finally:
        try: sys.stdout.flush(); sys.stderr.flush()
        except Exception: pass

def _copy_home(src_dir, dst_dir, cap):
    total = 0
    for root, dirs, files in os.walk(src_dir):
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p): total += os.lstat(p).st_size
    if total > cap:
        raise OSError("the working folder holds %d bytes, more than the %d a fork may copy" % (total, cap))
    _shutil.copytree(src_dir, dst_dir, symlinks=True)

def _reopen(old, new):
    # Every descriptor into the parent's folder now points at the same file in this branch's copy, at the same offset
    # and with the same flags: siblings share neither file contents nor offsets.
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            path = os.readlink("/proc/self/fd/%d" % fd)
        except OSError:
            continue
        if not path.startswith(old + "/"): continue
        info = dict(l.split(":", 1) for l in open("/proc/self/fdinfo/%d" % fd))
        pos, flags = int(info["pos"]), int(info["flags"].strip(), 8)
        if not _stat.S_ISREG(os.fstat(fd).st_mode): continue
        nfd = os.open(new + path[len(old):], flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC) & 0o7777777)
        os.lseek(nfd, pos, 0)
        os.dup2(nfd, fd, inheritable=not flags & 0o2000000); os.close(nfd)

def _become_branch(msg, fds, parent_ctl, rng):
    global _ctl, _home
    os.setpgid(0, 0)
    # the parent's random state, not the OS's: a fork equals a replay of the parent's calls
    if msg["fresh"]:
        if msg.get("seed") is not None: _seed(int(msg["seed"]))
    else: _random.setstate(rng)
    out, err, ctl = fds
    os.dup2(out, 1); os.dup2(err, 2); os.close(out); os.close(err)
    parent_ctl.close()  # the parent's socket: its end of file must reach the host when the parent ends
    _ctl = _socket.socket(fileno=ctl)
    new = os.path.join(_P["root"], "w" + os.urandom(6).hex())
    try:
        if msg["fresh"] or _home is None:
            os.mkdir(new, 0o700)
        else:
            _copy_home(_home, new, _P["copy_bytes"])
            _reopen(_home, new)
    except OSError as exc:
        _send(_ctl, {"error": "the working folder could not be copied: %s" % exc}); os._exit(1)
    _home = new
    os.chdir(new)
    os.environ["HOME"] = os.environ["TMPDIR"] = new
    import tempfile as _tf; _tf.tempdir = None
    _send(_ctl, {"pid": os.getpid()})

while True:
    msg, fds = _recv()
    op = msg.get("op")
    if op == "run":
        _rc = _run(msg["code"])
        # Threads besides this one (the sandbox pins BLAS and OpenMP pools to one thread, so there are none unless
        # the call started one): no thread can be stopped, so the host ends an interpreter that returns with one.
        for _wait in range(21):  # a thread joined by the call may still be leaving the kernel: up to 0.2 s for it
            try: _n = len(os.listdir("/proc/self/task"))
            except OSError: _n = len(sys._current_frames())
            if _n == 1 or _wait == 20: break
            _time.sleep(0.01)
        _send(_ctl, {"rc": _rc, "threads": _n - 1})
    elif op == "kill":
        for f in (os.killpg, os.kill):
            try: f(msg["pid"], _signal.SIGKILL)
            except OSError: pass
        _send(_ctl, {"ok": True})
    elif op == "fork":
        try:
            sys.stdout.flush(); sys.stderr.flush()
            _rng = _random.getstate()
            mid = os.fork()
        except OSError as exc:
            for f in fds: os.close(f)
            _send(_ctl, {"error": "fork failed: %s" % exc}); continue
        if mid == 0:
            try:
                if os.fork(): os._exit(0)
            except OSError:
                os._exit(3)
            _become_branch(msg, fds, _ctl, _rng)
            continue
        for f in fds: os.close(f)
        _, status = os.waitpid(mid, 0)
        _send(_ctl, {"ok": True} if status == 0 else {"error": "fork failed (the process limit is reached)"})
"""
