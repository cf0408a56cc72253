"""Persistent Python interpreters (``tools.python.persistent = true``): one interpreter per trajectory, kept between
its calls and forked at the tree's branch points (docs/concepts/stateful-tools.md).

A trajectory's first call starts a sandbox exactly as a stateless call does (same backend, uid lease, cgroup, limits,
seccomp filter), but the process in it stays: a *zygote* that never runs code. Each interpreter is a process forked
from it (fresh) or from another interpreter (a branch: a copy-on-write snapshot of its memory, with its working folder
copied). The child side is :mod:`arpo_env.tools.interpreter_child`. Everything forked from one fresh interpreter is
one *tree*: it shares the sandbox, so its uid, its cgroup (memory and process cap) and its ``/tmp``; separate trees
(other trajectories, other requests) are separated exactly like separate stateless calls.

Lifetime: an :class:`Interpreter` ends on :meth:`Interpreter.close` (the session's end, reset or close) or when it is
garbage-collected; a tree's sandbox ends with its last interpreter (its processes and uid killed, its folder removed,
its uid returned). A call that times out, floods its output or ends the process ends that interpreter only; the
observation says its state is lost and the next call starts a fresh one. A fork that cannot be made raises
:class:`ForkError`: never a silent fresh interpreter.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from arpo_env.tools.base import ToolResult, check_text_arg, tolerant_call, truncate_text
from arpo_env.tools.control_socket import message_length, parse_message, pending, recv_message, send_message
from arpo_env.tools.interpreter_child import LOOP
from arpo_env.tools.pipes import drain, output_limits, read_pipes
from arpo_env.tools.proc_memory import tree_pss
from arpo_env.tools.sandbox import (
    READY,
    SETUP,
    CallCgroup,
    SandboxError,
    ToolCancelled,
    bwrap_prefix,
    call_cgroups_available,
    cancel_event,
    child_env,
    interpreter_paths,
    kill_uid,
    sandbox_slot,
    uid_pool,
)

#: An interpreter's lifetime CPU budget, in calls' worth of ``cpu_s`` (each call gets ``cpu_s`` more than it used).
LIFETIME_CPU_CALLS = 64
#: What the model reads when its interpreter ended: the state is gone, and the next call says so by working fresh.
STATE_LOST = (
    "The Python interpreter was stopped: its variables, imports and files are lost; the next call starts "
    "a fresh interpreter."
)
#: What the model reads when a call returned with a thread of its still running (Python cannot stop a thread).
THREAD_LEFT = (
    "A thread this call started was still running when the call returned; a thread cannot be stopped, so the "
    "interpreter was stopped with it."
)
#: What the model reads when its interpreter broke the control protocol (wrote to the interpreter's own socket).
CHANNEL_BROKEN = "The interpreter wrote to its control channel (a message that is not its reply) and was stopped."
#: One request (one cancel scope: a served request) may hold at most this share of ``max_interpreters``.
REQUEST_SHARE = 4
_START_TIMEOUT_S = 60.0  # a fork's or fresh start's replies, each under this total deadline
_KILL_TIMEOUT_S = 10.0
_LIVE = {"n": 0}
# Live interpreters per cancel scope (a served request's cancel event), for the per-request cap.
_PER_SCOPE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Since the last interpreter_metrics(): forks made (fresh starts excluded), their seconds, forks that could not be
# made, the most live at once, and the largest summed PSS (bytes) that sample_interpreter_memory() saw.
_STATS: dict[str, Any] = {"forks": 0, "fork_s": 0.0, "failed": 0, "peak": 0, "pss": 0}  # pss: None when unreadable
_LIVE_LOCK = threading.Lock()
# Every tree whose sandbox is up (a tree leaves it in _teardown): what sample_interpreter_memory() measures.
_TREES: weakref.WeakSet = weakref.WeakSet()
# Sandboxes are started from this one long-lived thread: bwrap's --die-with-parent follows the thread that started
# it, and a persistent sandbox must outlive the worker thread of the call that happened to start it.
_LAUNCHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arpo-interpreters")


class ForkError(SandboxError):
    """An interpreter could not be forked (process or memory limit, working folder over the copy cap, a dead tree):
    an error for that trajectory, never a silent fresh interpreter."""


class InterpretersExhausted(ForkError):
    """No interpreter may start now: the process holds ``max_interpreters``, or this request its share of them.
    Transient (others end theirs): ``arpo serve`` answers it with 503 and ``Retry-After``, never a 500."""


def live_interpreters() -> int:
    """How many persistent interpreters this process holds now (every tool together)."""
    return _LIVE["n"]


def interpreter_metrics() -> dict[str, float]:
    """This process's persistent-interpreter figures since the previous call (``{}`` when none ran, so a stateless
    run logs nothing new): forks made, their total and mean milliseconds, forks that could not be made, the most
    interpreters live at once, and the largest summed PSS of their sandboxes' processes in MiB that
    :func:`sample_interpreter_memory` saw (0 when it was not called). The tree sampler adds them to each step's
    metrics (docs/concepts/stateful-tools.md)."""
    with _LIVE_LOCK:
        stats = dict(_STATS)
        _STATS.update(forks=0, fork_s=0.0, failed=0, peak=_LIVE["n"], pss=0)
    if not stats["peak"] and not stats["failed"]:
        return {}
    out = {
        "rollout/interpreter_forks": float(stats["forks"]),
        "rollout/interpreters_peak": float(stats["peak"]),
        "rollout/interpreter_fork_ms": 1e3 * stats["fork_s"] / stats["forks"] if stats["forks"] else 0.0,
        "rollout/interpreter_fork_ms_total": 1e3 * stats["fork_s"],
        "rollout/interpreter_forks_failed": float(stats["failed"]),
    }
    if stats["pss"] is not None:  # None: a sandbox's memory could not be read this step
        out["rollout/interpreter_pss_mib_peak"] = stats["pss"] / (1 << 20)
    return out


def sample_interpreter_memory() -> int:
    """The summed proportional set size (PSS, bytes) of every process in this process's live interpreters' sandboxes
    now (zygotes, interpreters and whatever they started; PSS splits a page shared by forks between them, so the
    copy-on-write pages of a fork count once in the sum), kept as the peak :func:`interpreter_metrics` reports.
    One scan of ``/proc`` plus one ``smaps_rollup`` per sandbox process (:func:`arpo_env.tools.proc_memory.tree_pss`):
    call it at a few chosen points (the tree sampler: once per decoding round), not per tool call. 0 when no
    interpreter is live."""
    with _LIVE_LOCK:
        roots = {t.proc.pid for t in list(_TREES) if t.proc is not None and not t.dead}
    total = tree_pss(roots)  # None: a sandbox process could not be read, so no figure rather than one too low
    with _LIVE_LOCK:
        _STATS["pss"] = None if total is None or _STATS["pss"] is None else max(_STATS["pss"], total)
    return total or 0


class _Tree:
    """One sandbox (zygote process, uid, cgroup, folder) and the interpreters forked inside it."""

    def __init__(self, tool: Any) -> None:
        # lock: membership only, never held while waiting on a process; zlock: one request at a time on the
        # zygote's socket (the zygote runs no model code; each wait has a total deadline)
        self.tool, self.members, self.dead, self.torn = tool, 0, False, False
        self.lock, self.zlock = threading.Lock(), threading.Lock()
        self.uid: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.group: CallCgroup | None = None
        self.ctl: socket.socket | None = None
        self.scratch = tempfile.mkdtemp(prefix="arpo-py-", dir=tool.scratch_root)
        try:
            self._start()
        except BaseException:
            self._teardown()
            raise
        with _LIVE_LOCK:
            _TREES.add(self)

    def _start(self) -> None:
        t = self.tool
        self.uid = uid_pool(t.uid_base).get() if t._uid_drop else None
        if self.uid is not None:
            os.chown(self.scratch, self.uid, self.uid)
        prefix = (
            bwrap_prefix(self.scratch, interpreter_paths(t.python_executable), t.disk_mb)
            if t.backend == "bwrap"
            else []
        )
        if self.uid is not None and call_cgroups_available():  # one group for the whole tree
            self.group = CallCgroup(self.uid, t.memory_mb << 20, t.max_procs)
            prefix = [*self.group.join_prefix(), *prefix]
        env = child_env(self.scratch)
        flags, env["PYTHONHASHSEED"] = (["-s", "-P"], "0") if t.reproducible_output else (["-I"], "")
        if not env["PYTHONHASHSEED"]:
            del env["PYTHONHASHSEED"]
        host, child = socket.socketpair()
        cfg = t._config(self.uid, None, None, self.scratch)
        cfg["limits"]["RLIMIT_CPU"] = max(1, int(t.cpu_s + 0.999)) * LIFETIME_CPU_CALLS
        cfg["persistent"] = {
            "fd": child.fileno(),
            "cpu_s": max(1, int(t.cpu_s + 0.999)),
            "root": self.scratch,
            "copy_bytes": t.fork_copy_mb << 20,
        }
        cmd = [
            *prefix,
            *t._no_aslr,
            t.python_executable,
            *flags,
            *(["-S"] if t.no_site else []),
            "-c",
            SETUP + LOOP,
            json.dumps(cfg),
        ]
        try:  # only the start on the launcher thread; the caller's thread waits for READY (starts run in parallel)
            self.proc = proc = _LAUNCHER.submit(
                subprocess.Popen,
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.scratch,
                env=env,
                start_new_session=True,
                pass_fds=(child.fileno(),),
            ).result()
        finally:
            child.close()
        self.ctl = host
        got, deadline = b"", time.monotonic() + _START_TIMEOUT_S
        out, err = proc.stdout, proc.stderr
        assert out is not None and err is not None  # both are pipes (Popen above)
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            while len(got) < len(READY) and time.monotonic() < deadline:
                if sel.select(timeout=0.1):
                    chunk = os.read(out.fileno(), len(READY) - len(got))
                    if not chunk:
                        break
                    got += chunk
        if got != READY:
            self._kill_all()
            tail = err.read().decode("utf-8", "replace").strip()[-800:] or "(no error output)"
            raise SandboxError(
                f"the persistent Python interpreter's sandbox failed to start: {tail}",
                hint="run `arpo doctor` to see the sandbox's state; docs/sandbox.md lists what each backend needs",
            )

    def branch(self, parent: _Branch | None, seed: int | None = None) -> _Branch:
        """A new interpreter: forked from ``parent`` (a copy of its state and folder, its random state included), or
        fresh from the zygote (``random`` and numpy seeded from ``seed``; None: from the OS).
        The tree's lock covers the membership only: the wait for the child's answers holds no lock of the tree."""
        with self.lock:
            if self.dead:
                raise ForkError("the interpreter's sandbox has ended", hint="start a new trajectory")
            scope = _reserve(self.tool.max_interpreters)
            self.members += 1
        try:
            if parent is None:
                with self.zlock:
                    return self._fork(None, scope, seed)
            with parent.lock:
                return self._fork(parent, scope)
        except BaseException:
            self.leave(scope)
            raise

    def _fork(self, parent: _Branch | None, scope: Any, seed: int | None = None) -> _Branch:
        if parent is not None and (parent.broken or pending(parent.ctl)):
            parent.broken = True  # it wrote more than its replies: its next call ends it
            raise ForkError("the interpreter could not be forked: its control channel misbehaved")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        host, child = socket.socketpair()
        via = parent.ctl if parent is not None else self.ctl
        assert via is not None  # a tree's channel is set by _start, which every tree asked to fork has passed
        t0 = time.monotonic()
        try:
            request = {"op": "fork", "fresh": parent is None, "seed": seed if parent is None else None}
            send_message(via, request, [out_w, err_w, child.fileno()])
        except OSError as exc:
            for fd in (out_r, err_r):
                os.close(fd)
            host.close()
            raise ForkError(f"the interpreter could not be forked: it has ended ({exc})") from exc
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            child.close()
        first = recv_message(via, _START_TIMEOUT_S)
        second = recv_message(host, _START_TIMEOUT_S) if first is not None and "ok" in first else None
        if second is None or not isinstance(second.get("pid"), int):
            for fd in (out_r, err_r):
                os.close(fd)
            host.close()
            if first is None and parent is not None:
                parent.broken = True  # no answer, or not one of ours, in time: that interpreter ends at its next call
            elif first is None:
                self._kill_all()  # the zygote did not answer: nothing of this sandbox can be trusted
            why = (second or first or {}).get("error", "the interpreter did not answer")
            raise ForkError(
                f"the Python interpreter could not be forked: {why}",
                hint="fewer branches per trajectory, a smaller working folder (tools.python.fork_copy_mb)"
                ", or a larger tools.python.max_procs / memory_mb",
            )
        took = time.monotonic() - t0
        if parent is not None:
            with _LIVE_LOCK:
                _STATS["forks"] += 1
                _STATS["fork_s"] += took
        return _Branch(self, host, out_r, err_r, second["pid"], took, scope)

    def kill(self, pid: int) -> None:
        """SIGKILL one interpreter's process group, by the zygote (which sees the sandbox's process ids)."""
        with self.zlock:
            if self.dead or self.ctl is None:  # no channel: the sandbox never started, nothing of it runs
                return
            try:
                send_message(self.ctl, {"op": "kill", "pid": pid})
                ok = recv_message(self.ctl, _KILL_TIMEOUT_S) is not None
            except OSError:
                ok = False
            if not ok:  # the zygote is gone: nothing in this sandbox can be trusted to end, so all of it ends
                self._kill_all()

    def leave(self, scope: Any = None) -> None:
        """One interpreter ended (or was never made); the last one takes the sandbox with it."""
        with self.lock:
            self.members -= 1
            with _LIVE_LOCK:
                _LIVE["n"] -= 1
                if scope is not None and scope in _PER_SCOPE:
                    _PER_SCOPE[scope] -= 1
            if self.members > 0:
                return
        self._teardown()

    def _kill_all(self) -> None:
        self.dead = True
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.uid is not None:
            kill_uid(self.uid)
        if self.group is not None:
            self.group.close()

    def _teardown(self) -> None:
        with _LIVE_LOCK:  # once: the last interpreter's leave() and a failed start may both end the tree
            if self.torn:
                return
            self.torn = True
            _TREES.discard(self)
        self._kill_all()
        if self.ctl is not None:
            self.ctl.close()
        if self.proc is not None:
            self.proc.wait()
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self.uid is not None:
            uid_pool(self.tool.uid_base).put(self.uid)
            self.uid = None


def _reserve(cap: int) -> Any:
    """Count one more live interpreter, in the process and in the calling thread's cancel scope (a served request:
    at most ``cap // REQUEST_SHARE`` of them, at least 1); returns that scope's key (None outside one)."""
    scope = cancel_event()
    share = max(1, cap // REQUEST_SHARE)
    with _LIVE_LOCK:
        if _LIVE["n"] >= cap:
            raise InterpretersExhausted(
                f"{_LIVE['n']} persistent Python interpreters are live in this process, the most "
                f"tools.python.max_interpreters ({cap}) allows",
                hint="fewer trajectories or branches at once, or raise tools.python.max_interpreters "
                "(each interpreter holds 10-30 MB)",
            )
        if scope is not None and _PER_SCOPE.get(scope, 0) >= share:
            raise InterpretersExhausted(
                f"this request holds {share} persistent Python interpreters, the most one request may "
                f"(tools.python.max_interpreters / {REQUEST_SHARE})",
                hint="fewer choices (n) per request, or raise tools.python.max_interpreters",
            )
        _LIVE["n"] += 1
        if scope is not None:
            _PER_SCOPE[scope] = _PER_SCOPE.get(scope, 0) + 1
        _STATS["peak"] = max(_STATS["peak"], _LIVE["n"])
    return scope


class _Branch:
    """One interpreter process: its control socket and output pipes (host ends)."""

    def __init__(
        self, tree: _Tree, ctl: socket.socket, out_r: int, err_r: int, pid: int, fork_s: float, scope: Any = None
    ) -> None:
        self.tree, self.ctl, self.out, self.err, self.pid, self.fork_s = tree, ctl, out_r, err_r, pid, fork_s
        self.scope, self.open, self.broken, self.lock = scope, True, False, threading.Lock()

    def run(self, code: str) -> tuple[bytes, bytes, int | None, str]:
        """Run one call: (stdout, stderr, exit status, "ok" | "timeout" | "flood" | "ended" | "cancelled" |
        "channel" (the control channel misbehaved) | "threads" (a thread of the call still runs)). Every status but
        "ok" has ended the interpreter."""
        with self.lock:
            out, err, rc, status = self._run(code)
        if status != "ok":
            self.close()
        return out, err, rc, status

    def _run(self, code: str) -> tuple[bytes, bytes, int | None, str]:
        tool = self.tree.tool
        keep, flood = output_limits(tool.max_output_chars)
        deadline, cancel = time.monotonic() + tool.timeout_s, cancel_event()
        if self.broken or pending(self.ctl):  # bytes nobody asked for since the last reply: not our channel now
            return b"", b"", None, "channel"
        try:
            send_message(self.ctl, {"op": "run", "code": code})
        except OSError:
            return b"", b"", None, "ended"
        (out, err), reply, status = read_pipes(
            (self.out, self.err),
            keep=keep,
            flood=flood,
            deadline=deadline,
            cancel=cancel,
            control=self.ctl.fileno(),
            stop=lambda _now, reply: (n := message_length(reply)) is not None and (n < 0 or len(reply) >= n),
        )
        bufs = {self.out: out, self.err: err}
        drain(bufs, keep=keep, limit=flood)  # written before the reply (or the end): already in the pipes
        rc = None
        if status == "ok":  # the code can write to its own end of the socket: anything but one reply is no reply
            answer = parse_message(reply) or {}
            rc, threads = answer.get("rc"), answer.get("threads", 0)
            if not isinstance(rc, int) or isinstance(rc, bool) or not isinstance(threads, int):
                rc, status = None, "channel"
            elif threads > 0:
                status = "threads"
        return bytes(bufs[self.out]), bytes(bufs[self.err]), rc, status

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        self.tree.kill(self.pid)  # its group too: nothing it started outlives it
        self.ctl.close()
        for fd in (self.out, self.err):
            os.close(fd)
        self.tree.leave(self.scope)


class _Slot:
    """What an :class:`Interpreter` holds, apart from it, so a garbage-collected interpreter still closes it."""

    def __init__(self, branch: _Branch | None = None) -> None:
        self.branch = branch

    def close(self) -> None:
        branch, self.branch = self.branch, None
        if branch is not None:
            branch.close()


class Interpreter:
    """One trajectory's persistent Python interpreter (see the module docstring); made by
    :meth:`PythonTool.open_interpreter`. Started lazily by the first call."""

    name = "python"

    def __init__(self, tool: Any, _branch: _Branch | None = None, seed: int | None = None) -> None:
        #: Seeds ``random`` and numpy when this interpreter starts fresh (None: the OS); a started one's forks
        #: continue its random state instead.
        self.tool, self._slot, self.seed = tool, _Slot(_branch), seed
        self._finalizer = weakref.finalize(self, self._slot.close)

    @property
    def started(self) -> bool:
        """Whether a process holds this interpreter's state now."""
        return self._slot.branch is not None

    @tolerant_call
    def __call__(self, code: str) -> ToolResult:
        """Run ``code`` in this interpreter; see :meth:`PythonTool.__call__`."""
        start = time.monotonic()
        problem = check_text_arg(code, "code", self.tool.max_code_chars)
        if problem:
            return ToolResult(text=problem, error=True, meta={"invalid_arguments": True})
        if (cancel := cancel_event()) is not None and cancel.is_set():
            raise ToolCancelled("the call was cancelled before it started")
        branch = self._slot.branch
        fresh = branch is None
        if branch is None:
            tree = _Tree(self.tool)
            try:
                branch = self._slot.branch = tree.branch(None, self.seed)
            except BaseException:
                tree._teardown()
                raise
        with sandbox_slot():
            out, err, rc, status = branch.run(code)
        if status != "ok":  # the branch has ended itself
            self._slot.branch = None
        if status == "cancelled":
            self._slot.close()
            raise ToolCancelled(
                f"the call was cancelled after {time.monotonic() - start:.1f} s; its interpreter was killed"
            )
        if status in ("ended", "channel"):
            body, _ = truncate_text(err.decode("utf-8", "replace").strip(), self.tool.max_output_chars)
            why = (
                CHANNEL_BROKEN
                if status == "channel"
                else (
                    "The interpreter ended during this call (it exited, crashed or was killed for exceeding a resource "
                    "limit)."
                )
            )
            result = ToolResult(
                text=(body + "\n" if body else "") + why,
                error=True,
                meta={
                    "returncode": None,
                    "timed_out": False,
                    "truncated": False,
                    "channel_broken": status == "channel",
                },
            )
        elif status == "threads":
            result = self.tool._result(out, err, rc, "ok")
            result.text, result.error, result.meta["thread_left"] = result.text + "\n" + THREAD_LEFT, True, True
        else:
            result = self.tool._result(out, err, rc, status)
        if self._slot.branch is None:
            result.text += "\n" + STATE_LOST
        result.latency_s = time.monotonic() - start
        result.meta.update(
            persistent=True,
            interpreter_lost=self._slot.branch is None,
            fresh_interpreter=fresh,
            network_isolated=self.tool.isolation["network_isolation"],
            isolation_level=self.tool.isolation["level"],
            backend=self.tool.backend,
        )
        return result

    def fork(self) -> Interpreter:
        """A new interpreter that continues from this one's state (a copy-on-write fork and a copy of its working
        folder); later changes on either side stay on that side. Not started yet: not started either.
        Raises ForkError when the fork cannot be made."""
        parent = self._slot.branch
        if parent is None:  # nothing ran yet: the copy starts as this one would, from the same seed
            return Interpreter(self.tool, seed=self.seed)
        try:
            return Interpreter(self.tool, parent.tree.branch(parent))
        except ForkError:  # every fork that could not be made (cap, dead tree, refused copy) is counted
            with _LIVE_LOCK:
                _STATS["failed"] += 1
            raise

    @property
    def fork_s(self) -> float | None:
        """Seconds the fork (or fresh start) that made this interpreter's process took."""
        return self._slot.branch.fork_s if self._slot.branch is not None else None

    def close(self) -> None:
        """End the interpreter: its process group is killed; the last one of a tree ends the sandbox."""
        self._slot.close()

    def schema(self) -> dict[str, Any]:
        return self.tool.schema()
