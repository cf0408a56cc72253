"""A sandboxed Python interpreter tool (replaces the reference's unsandboxed ``subprocess.run``,
docs/concepts/reference-choices.md#python-tool).

Every call runs in a fresh interpreter started with ``-I`` (isolated mode: no ``PYTHON*`` variables, no user site,
script directory not on ``sys.path``) and a fixed, minimal environment, so no host variable (API keys included)
reaches the code. A small bootstrap inside the child applies the limits and then runs the code.

The sandbox itself (the child-side bootstrap script, the limits, the uid pool, network namespaces, the backends'
capability probe) lives in :mod:`arpo_env.tools.sandbox`, whose docstring lists what it protects against and what it
does not; this module is the tool: settings, running a call, collecting and formatting its output.

Reproducible output (``reproducible_output=True``, the default): the same code prints the same text in every run,
so a training run is reproducible from its seed. The child gets a fixed hash seed (``PYTHONHASHSEED=0``: set and
dict-of-str order) and, where ``setarch`` exists, no address-space randomization (object reprs such as
``<generator object at 0x...>``, which a model does print, otherwise differ per run and change the next sampled
tokens). It then runs with ``-s -P`` and a clean environment instead of ``-I`` (which would ignore the hash seed);
the isolation is the same. ASLR guards a process against memory-corruption exploits, which code that already runs
arbitrary Python does not need. Applies to the subprocess and bwrap backends.

Deliberate differences from the reference (docs/concepts/reference-choices.md#python-tool): empty stdout returns ``"(no
output)"`` once
instead of re-running the code; output is capped; the timeout message is in English.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from arpo_base.errors import ArpoError, ConfigError
from arpo_env.tools.base import ToolResult, check_text_arg, function_schema, tolerant_call, truncate_text
from arpo_env.tools.isolation import check_level, describe, level_of, network_isolated, network_required
from arpo_env.tools.pipes import output_limits, read_pipes
from arpo_env.tools.sandbox import (
    _BACKENDS,
    BOOTSTRAP,
    PRIVATE_DIRS,
    READY,
    CallCgroup,
    SandboxError,
    ToolCancelled,
    bwrap_prefix,
    call_cgroups_available,
    cancel_event,
    check_uid_base,
    child_env,
    interpreter_paths,
    kill_uid,
    sandbox_slot,
    set_max_concurrency,
    uid_pool,
)
from arpo_env.tools.sandbox_docker import CODE_FILE, DEFAULT_IMAGE, run_container

__all__ = ["PythonTool", "SandboxError", "sandbox_capabilities", "set_max_concurrency"]

_log = logging.getLogger(__name__)
_SELF_TESTS: dict[tuple, dict] = {}
_SELF_TESTS_LOCK = threading.Lock()


def sandbox_capabilities(backend: str = "auto") -> dict:
    """The isolation a default ``PythonTool(backend=backend)`` reaches here (its :attr:`PythonTool.isolation`), or
    ``{"backend", "available": False, "level": None, "detail": reason}`` when its sandbox does not work."""
    try:
        return dict(
            PythonTool(backend=backend, allow_unisolated_python=True, require_network_isolation=False).isolation
        )
    except ConfigError as exc:
        if backend not in _BACKENDS:
            raise
        return {
            "backend": backend,
            "available": False,
            "level": None,
            "network_isolation": False,
            "uid_drop": False,
            "separate_user": False,
            "private_filesystem": False,
            "detail": str(exc),
        }


class PythonTool:
    """Runs Python code in a fresh sandboxed interpreter and returns what it printed."""

    name = "python"

    def __init__(
        self,
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        cpu_s: float | None = None,
        max_output_chars: int = 10_000,
        max_procs: int = 32,
        max_file_mb: int = 64,
        max_code_chars: int = 100_000,
        backend: str = "auto",
        echo_last_expr: bool = True,
        require_network_isolation: bool | None = None,
        python_executable: str | None = None,
        no_site: bool = False,
        uid_base: int = 62_000,
        scratch_root: str | None = None,
        docker_image: str = DEFAULT_IMAGE,
        reproducible_output: bool = True,
        allow_unisolated_python: bool = False,
        namespaces: bool = True,
        disk_mb: int = 64,
        persistent: bool = False,
        max_interpreters: int = 64,
        fork_copy_mb: int = 16,
    ) -> None:
        """Configure the sandbox and prove it works: a trivial program runs under it before the first call.

        Args:
            timeout_s: Wall-clock limit per call (the reference uses 120 s).
            memory_mb: Address-space limit (``RLIMIT_AS``).
            cpu_s: CPU-time limit; defaults to ``timeout_s + 1`` so that the wall-clock timeout (and its message)
                wins for single-threaded code, while multi-threaded CPU burners are still stopped.
            max_output_chars: Cap on the returned text; longer output is cut with a visible marker.
            max_procs: Process limit (``RLIMIT_NPROC``; enforced for the per-call uid or inside a user namespace).
            max_file_mb: Largest file the code may write (``RLIMIT_FSIZE``).
            max_code_chars: Longer code is rejected without running.
            backend: ``"auto"`` (bwrap when installed and working, else subprocess; :attr:`isolation` says which),
                ``"subprocess"``, ``"bwrap"``, ``"docker"``.
            echo_last_expr: Print a final bare expression as a REPL would (reference behaviour).
            require_network_isolation: Refuse (``ConfigError``) when the code could reach the network. None (the
                default): required unless ``allow_unisolated_python``; True: required even then; False: not
                required by itself (the level check still refuses a reachable network without the opt-in).
            python_executable: Interpreter for the code (default: the current one; reference: a conda env).
            no_site: Also pass ``-S`` (no site-packages: stdlib only).
            uid_base: First uid of the per-call uid pool (root hosts only).
            scratch_root: Where scratch directories are created (default: the system temp dir).
            docker_image: Image for ``backend="docker"``: any image with ``python`` on its PATH; the default is
                built from this machine's Debian package sources by ``arpo sandbox build-image``.
            reproducible_output: Fixed hash seed and no address randomization in the child, so the same code prints
                the same text in every run (see the module docstring). False: ``python -I`` with randomization.
            allow_unisolated_python: Accept an isolation level below ``process`` (see
                :mod:`arpo_env.tools.isolation`): the model's code may then reach the network or act as this user.
            namespaces: False: the subprocess backend enters no namespace (as on a kernel that forbids them), so
                the code reaches the network; refused unless ``allow_unisolated_python``.
            disk_mb: Size of each writable folder the code gets (its scratch folder, ``/tmp``, ``/dev/shm``): each
                is a tmpfs of this size (bwrap, docker, and subprocess as root).
            persistent: One interpreter per trajectory, kept between its calls and forked at tree branch points
                (:mod:`arpo_env.tools.interpreter`, docs/concepts/stateful-tools.md); calls then go through
                :meth:`open_interpreter` (a session does it). Not with the docker backend.
            max_interpreters: The most persistent interpreters live at once in this process (every tool together).
            fork_copy_mb: The largest working folder a fork copies; a larger one makes the fork fail.
        """
        for key, value in (
            ("timeout_s", timeout_s),
            ("memory_mb", memory_mb),
            ("max_output_chars", max_output_chars),
            ("max_procs", max_procs),
            ("max_file_mb", max_file_mb),
            ("max_code_chars", max_code_chars),
            ("disk_mb", disk_mb),
            ("max_interpreters", max_interpreters),
            ("fork_copy_mb", fork_copy_mb),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"python tool setting '{key}' must be a positive number, got {value!r}")
        for key, value in (
            ("reproducible_output", reproducible_output),
            ("namespaces", namespaces),
            ("persistent", persistent),
            ("allow_unisolated_python", allow_unisolated_python),
            ("require_network_isolation", True if require_network_isolation is None else require_network_isolation),
        ):
            if not isinstance(value, bool):
                raise ConfigError(f"python tool setting '{key}' must be true or false, got {value!r}")
        if backend not in _BACKENDS:
            raise ConfigError(f"unknown python sandbox backend {backend!r}; choose one of {_BACKENDS}")
        if not isinstance(docker_image, str) or not docker_image.strip():
            raise ConfigError(
                f"python tool setting 'docker_image' must be an image name, got {docker_image!r}",
                hint=f"the default is {DEFAULT_IMAGE} (arpo sandbox build-image)",
            )
        if persistent and backend == "docker":
            raise ConfigError(
                "python tool setting 'persistent' is not supported by the docker backend: a container "
                "per call cannot keep an interpreter between calls",
                hint='use backend = "bwrap" (or "auto") for persistent interpreters, or persistent = false',
            )
        self.persistent, self.max_interpreters, self.fork_copy_mb = persistent, int(max_interpreters), int(fork_copy_mb)
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.cpu_s = float(cpu_s if cpu_s is not None else timeout_s + 1)
        self.max_output_chars, self.max_procs = int(max_output_chars), int(max_procs)
        self.max_file_mb, self.max_code_chars, self.disk_mb = int(max_file_mb), int(max_code_chars), int(disk_mb)
        self.echo_last_expr, self.no_site, self.uid_base = echo_last_expr, no_site, check_uid_base(uid_base)
        self.python_executable = python_executable or sys.executable
        self.scratch_root, self.docker_image = scratch_root, docker_image
        self.reproducible_output, self.namespaces = reproducible_output, namespaces
        setarch = shutil.which("setarch") if reproducible_output else None
        self._no_aslr = [setarch, platform.machine(), "-R"] if setarch else []
        # As root every call runs under its own unprivileged uid (never root: it would read and kill anything).
        self._uid_drop = os.geteuid() == 0 and backend != "docker"
        self.isolation = self._choose_backend(
            backend, not network_required(allow_unisolated_python, require_network_isolation)
        )
        self.backend, self._net = self.isolation["backend"], self.isolation.pop("_net")
        check_level(self.isolation, allow_unisolated_python, require_network_isolation)

    def _choose_backend(self, backend: str, may_drop_network: bool) -> dict:
        """Run the self-test for ``backend`` and return what it proved; ConfigError with the reason if it fails.

        ``auto`` takes bwrap when it is installed and passes, and says in ``detail`` why it did not otherwise."""
        note = ""
        if backend == "auto":
            backend = "subprocess"
            if shutil.which("bwrap"):
                try:
                    return self._self_test("bwrap", net=False)
                except SandboxError as exc:
                    note = f" (auto: bwrap is installed but failed: {exc.message})"
                    _log.warning(
                        "python tool: bwrap is installed but failed its self-test, using the subprocess backend: %s",
                        exc.message,
                    )
            else:
                note = " (auto: bwrap is not installed)"
        try:
            record = self._self_test(backend, net=backend == "subprocess" and self.namespaces)
        except SandboxError as exc:
            if not (backend == "subprocess" and may_drop_network):
                raise ConfigError(
                    f"python sandbox backend {backend!r} does not work here: {exc.message}" + note,
                    hint=exc.hint or "install bubblewrap, or see docs/sandbox.md",
                ) from exc
            record = self._self_test(backend, net=False)  # explicitly allowed: unisolated and network reachable
        record["detail"] += note
        return record

    def _self_test(self, backend: str, net: bool) -> dict:
        """Run a trivial program under the exact command line calls use; cached per configuration."""
        key = (
            backend,
            net,
            self.python_executable,
            self.no_site,
            self.reproducible_output,
            tuple(self._no_aslr),
            self.scratch_root,
            self.uid_base,
            self.docker_image,
            self._uid_drop,
            os.geteuid(),
        )
        self.backend, self._net = backend, net
        with _SELF_TESTS_LOCK:
            if key in _SELF_TESTS:
                return dict(_SELF_TESTS[key])
        if backend == "bwrap" and not shutil.which("bwrap"):
            raise SandboxError("bwrap is not installed", hint="apt-get install bubblewrap")
        # Proof by attempts: host files of this user that the code must not read (a world-readable one, a 0600 one,
        # one inside a 0700 folder) and a listener on the host's 127.0.0.1 it must not reach.
        planted = tempfile.mkdtemp(prefix="arpo-selftest-", dir=self.scratch_root)
        listener = socket.socket()
        try:
            os.chmod(planted, 0o755)
            token = os.urandom(8).hex()
            files = {}
            for name, rel, mode in (
                ("read a world-readable host file", "public", 0o644),
                ("read a 0600 file of the server's user", "private", 0o600),
                ("read a file in a 0700 folder of the server's user", "closed/file", 0o644),
            ):
                path = os.path.join(planted, rel)
                if "/" in rel:
                    os.mkdir(os.path.dirname(path), 0o700)
                with open(path, "w") as f:
                    f.write(token)
                os.chmod(path, mode)
                files[name] = path
            listener.bind(("127.0.0.1", 0))
            listener.listen(4)
            probe = {"token": token, "files": files, "port": listener.getsockname()[1], "dir": planted}
            out, _, _, _ = (self._run_docker if backend == "docker" else self._run_process)("pass", probe=probe)
        except SandboxError:
            raise
        except Exception as exc:  # no interpreter, no docker package or engine, no free uid: the sandbox's failure
            raise SandboxError(f"{type(exc).__name__}: {exc}", hint=getattr(exc, "hint", None)) from exc
        finally:
            listener.close()
            shutil.rmtree(planted, ignore_errors=True)
        try:
            facts = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise SandboxError(f"the sandbox self-test printed no report: {out[-300:]!r}") from exc
        uid = self.uid_base if self._uid_drop else None
        level = level_of(backend, facts, os.geteuid())
        record = {
            "backend": backend,
            "available": True,
            "level": level,
            "network_isolation": network_isolated(facts),
            "separate_user": facts["uid"] != os.geteuid() and facts["userns"] == "mapped",
            "uid_drop": uid is not None,
            "private_tmp": facts["attempts"]["read a world-readable host file"] != "read",
            "private_filesystem": level == "filesystem",
            "attempts": facts["attempts"],
            "resource_limits": self._limits_mechanism(backend),
            "detail": describe(backend, facts, uid, os.geteuid()),
            "_net": net,
        }
        with _SELF_TESTS_LOCK:
            _SELF_TESTS[key] = record
        return dict(record)

    def schema(self) -> dict:
        """OpenAI/Hermes function schema for the JSON tool-call protocol."""
        return function_schema(self.name, self.__call__)

    @tolerant_call
    def __call__(self, code: str) -> ToolResult:
        """Execute Python code in a fresh sandboxed interpreter; the printed output (or the traceback) is returned.

        Args:
            code: Python source. A final bare expression is printed, as in a REPL.
        """
        if self.persistent:  # the state lives in a trajectory's interpreter: a bare call has none to use
            raise ArpoError(
                "a persistent python tool runs code in a trajectory's interpreter, not in a bare call",
                hint="call tool.open_interpreter() and run code through it (ToolSession and ToolTextEnv "
                "do), or set persistent = false",
            )
        start = time.monotonic()
        problem = check_text_arg(code, "code", self.max_code_chars)
        if problem:
            return ToolResult(text=problem, error=True, meta={"invalid_arguments": True})
        if (cancel := cancel_event()) is not None and cancel.is_set():
            raise ToolCancelled("the call was cancelled before it started")
        with sandbox_slot():
            try:
                run = self._run_docker if self.backend == "docker" else self._run_process
                out, err, returncode, status = run(code)
                if status == "cancelled":
                    raise ToolCancelled(
                        f"the call was cancelled after {time.monotonic() - start:.1f} s; its process was killed"
                    )
                result = self._result(out, err, returncode, status)
            except ArpoError:  # SandboxError or no free uid (the sandbox failed, not the code), ToolCancelled: raised
                raise
            except Exception as exc:
                raise SandboxError(f"the Python tool's sandbox failed: {type(exc).__name__}: {exc}") from exc
        result.latency_s = time.monotonic() - start
        result.meta["network_isolated"] = self.isolation["network_isolation"]
        result.meta["isolation_level"] = self.isolation["level"]
        result.meta["backend"] = self.backend
        return result

    def open_interpreter(self, seed: int | None = None) -> Any:
        """A new persistent interpreter for one trajectory (:class:`arpo_env.tools.interpreter.Interpreter`; needs
        ``persistent=True``); its first call starts it, with ``random`` and numpy seeded from ``seed`` (None: the
        OS)."""
        if not self.persistent:
            raise ConfigError("open_interpreter() needs a persistent python tool", hint="set persistent = true")
        from arpo_env.tools.interpreter import Interpreter

        return Interpreter(self, seed=seed)

    def run_many(self, codes: list[str], max_workers: int = 8) -> list[ToolResult]:
        """Run several snippets concurrently (bounded by ``max_workers`` and the module-wide sandbox limit)."""
        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            return list(pool.map(lambda c: self(c), codes))

    # -- backends -------------------------------------------------------------------------------------------

    def _limits_mechanism(self, backend: str) -> str:
        """What bounds a call's memory and process count, all its processes together or each alone."""
        if backend == "docker":
            return "the container's memory and PID limits (all of the call's processes together)"
        if self._uid_drop and call_cgroups_available():
            return "cgroup v1 memory and pids controllers, one group per call (all of its processes together)"
        return (
            "rlimits: RLIMIT_AS per process, RLIMIT_NPROC per uid"
            if self._uid_drop or backend == "bwrap"
            else "rlimits: RLIMIT_AS per process (no process cap)"
        )

    def _config(
        self, uid: int | None, code_file: str | None, probe: dict | None = None, scratch: str = ""
    ) -> dict[str, Any]:
        limits = {
            "RLIMIT_AS": self.memory_mb << 20,
            "RLIMIT_CPU": max(1, int(self.cpu_s + 0.999)),
            "RLIMIT_FSIZE": self.max_file_mb << 20,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": 256,
        }
        net = self._net and self.backend == "subprocess"
        userns = os.geteuid() != 0 and (net or self.backend == "bwrap")
        # RLIMIT_NPROC counts all processes of a (user namespace, uid): only meaningful for the per-call uid, or
        # for a non-root host inside its own user namespace (kernel >= 5.14). The kernel never enforces it for root.
        if uid is not None or userns:
            limits["RLIMIT_NPROC"] = self.max_procs
        # Subprocess as root: a mount namespace makes the interpreter reachable for the sandbox uid and gives the code
        # private world-writable folders (see mounts() in the bootstrap); never without the per-call uid.
        # The self-test's planted folder is exposed like any host folder outside the private ones, so its attempts
        # test the uid's rights, not a mount that hides the files.
        expose = [*interpreter_paths(self.python_executable), *([probe["dir"]] if probe else [])]
        mounts = (
            {"expose": expose, "private": list(PRIVATE_DIRS), "keep": [scratch]} if uid is not None and net else None
        )
        return {
            "code_file": code_file,
            "net": net,
            "uid": uid,
            "limits": limits,
            "probe": probe,
            "echo": self.echo_last_expr,
            "mounts": mounts,
            "disk_kb": self.disk_mb << 10,
            "no_userns": True,
            "own_dir": scratch if self.backend == "bwrap" and uid is not None else None,
        }

    def _run_process(self, code: str, probe: dict | None = None) -> tuple[bytes, bytes, int | None, str]:
        uid = uid_pool(self.uid_base).get() if self._uid_drop else None
        scratch = tempfile.mkdtemp(prefix="arpo-py-", dir=self.scratch_root)
        proc, collected, group = None, False, None
        try:
            if uid is not None:
                os.chown(scratch, uid, uid)
            prefix = (
                bwrap_prefix(scratch, interpreter_paths(self.python_executable), self.disk_mb)
                if self.backend == "bwrap"
                else []
            )
            if uid is not None and call_cgroups_available():
                # The call's group, joined before anything of the call runs: memory (tmpfs pages included) and
                # process count are bounded for all its processes together.
                group = CallCgroup(uid, self.memory_mb << 20, self.max_procs)
                prefix = [*group.join_prefix(), *prefix]
            env = child_env(scratch)
            if self.reproducible_output:  # -I would ignore PYTHONHASHSEED; the environment is clean anyway
                flags, env["PYTHONHASHSEED"] = ["-s", "-P"], "0"
            else:
                flags = ["-I"]
            flags += ["-S"] if self.no_site else []
            cmd = [
                *prefix,
                *self._no_aslr,
                self.python_executable,
                *flags,
                "-c",
                BOOTSTRAP,
                json.dumps(self._config(uid, None, probe, scratch)),
            ]
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=scratch,
                env=env,
                start_new_session=True,
            )
            assert proc.stdin is not None, "Popen was given stdin=PIPE"
            try:
                proc.stdin.write(code.encode("utf-8", "replace"))
                proc.stdin.close()
            except BrokenPipeError:
                pass
            out, err, status = self._collect(proc, uid)  # kills stragglers itself on every normal path
            collected = True
            if status == "cancelled":  # killed, perhaps before the sandbox was ready: not the sandbox's failure
                return out, err, proc.returncode, status
            return (*_strip_ready(out, err, proc.returncode, status), proc.returncode, status)
        finally:
            if proc is not None:
                if not collected:
                    self._kill(proc, uid)
                proc.wait()
                for stream in (proc.stdout, proc.stderr):
                    assert stream is not None, "Popen was given stdout=PIPE and stderr=PIPE"
                    stream.close()
            shutil.rmtree(scratch, ignore_errors=True)
            if group is not None:
                group.close()
            if uid is not None:
                uid_pool(self.uid_base).put(uid)

    def _kill(self, proc: subprocess.Popen, uid: int | None) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if uid is not None:
            kill_uid(uid)

    def _collect(self, proc: subprocess.Popen, uid: int | None) -> tuple[bytes, bytes, str]:
        """Read stdout/stderr incrementally until both close, the deadline passes or the output limit is hit."""
        keep, flood = output_limits(self.max_output_chars)
        deadline = time.monotonic() + self.timeout_s
        exited_at: float | None = None

        def exited(now: float, _reply: bytes) -> bool:
            nonlocal exited_at
            if exited_at is None and proc.poll() is not None:
                exited_at = now  # stragglers holding the pipes must not stretch the call
                self._kill(proc, uid)
            return exited_at is not None and now - exited_at > 1.0

        assert proc.stdout is not None and proc.stderr is not None, "the caller opens both as pipes"
        (out, err), _, status = read_pipes(
            (proc.stdout.fileno(), proc.stderr.fileno()),
            keep=keep,
            flood=flood,
            deadline=deadline,
            cancel=cancel_event(),  # the caller's: set = nobody waits for this call any more
            stop=exited,
        )
        if status == "ok":
            try:  # both pipes closed; the process may still be running (it closed them itself)
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                status = "timeout"
        self._kill(proc, uid)
        return bytes(out), bytes(err), status

    def _result(self, out: bytes, err: bytes, returncode: int | None, status: str) -> ToolResult:
        stdout = out.decode("utf-8", "replace").strip()
        stderr = err.decode("utf-8", "replace").strip()
        meta: dict[str, Any] = {"returncode": returncode, "timed_out": status == "timeout"}
        note = ""  # appended after truncation so a limit message is never cut off
        if status == "timeout":
            body, note = stdout, f"Execution timed out after {self.timeout_s:g} seconds; the process was killed."
        elif status == "flood":
            body, note = stdout, "[output limit exceeded: the process was stopped]"
        elif returncode == 0:
            body = stdout or "(no output)"
        elif returncode is not None and returncode < 0:
            body, note = stderr, self._signal_message(-returncode)
        else:
            body = stderr or f"Process exited with code {returncode} and no error output."
            meta["stdout"] = truncate_text(stdout, self.max_output_chars)[0]
        error = not (returncode == 0 and status == "ok")
        text, truncated = truncate_text(body, self.max_output_chars)
        if note:
            text = f"{text}\n{note}" if text else note
        meta["truncated"] = truncated
        return ToolResult(text=text, error=error, meta=meta)

    def _signal_message(self, signum: int) -> str:
        if signum == signal.SIGXCPU:
            return f"CPU time limit exceeded ({self.cpu_s:g} s); the process was killed."
        if signum == signal.SIGKILL:
            return "The process was killed (SIGKILL), e.g. for exceeding a resource limit."
        return f"The process was terminated by signal {signal.Signals(signum).name}."

    def _run_docker(self, code: str, probe: dict | None = None) -> tuple[bytes, bytes, int | None, str]:
        # The self-test checks the image first: a missing one is named with the command that builds it.
        out, err, returncode, status = run_container(
            self.docker_image,
            ["python", "-I", "-c", BOOTSTRAP, json.dumps(self._config(None, CODE_FILE, probe))],
            code,
            memory_mb=self.memory_mb,
            max_procs=self.max_procs,
            disk_mb=self.disk_mb,
            timeout_s=self.timeout_s,
            max_output_chars=self.max_output_chars,
            environment=child_env("/scratch"),
            scratch_root=self.scratch_root,
            check_image=probe is not None,
        )
        if status == "cancelled":  # killed, perhaps before the sandbox was ready: not the sandbox's failure
            return out, err, returncode, status
        return (*_strip_ready(out, err, returncode, status), returncode, status)


def _strip_ready(out: bytes, err: bytes, returncode: int | None, status: str) -> tuple[bytes, bytes]:
    """Remove the bootstrap's READY mark from stdout; without it the sandbox itself failed (SandboxError), since the
    model's code only runs after the mark is written."""
    if out.startswith(READY):
        return out[len(READY) :], err
    what = "timed out before the sandbox was ready" if status == "timeout" else f"exited with code {returncode}"
    tail = err.decode("utf-8", "replace").strip()[-800:] or "(no error output)"
    raise SandboxError(
        f"the Python tool's sandbox failed to start ({what}): {tail}",
        hint="run `arpo doctor` to see the sandbox's state; docs/sandbox.md lists what each backend needs",
    )
