"""A sandboxed Python interpreter tool (replaces the reference's unsandboxed ``subprocess.run``, spec §5.1, §10.9-10).

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

Deliberate differences from the reference (spec §10.9, §10.10, §10.24): empty stdout returns ``"(no output)"`` once
instead of re-running the code; output is capped; the timeout message is in English.
"""

from __future__ import annotations

import json
import os
import platform
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from arpo_base.errors import ConfigError
from arpo_env.tools.base import ToolResult, check_text_arg, function_schema, tolerant_call, truncate_text
from arpo_env.tools.sandbox import (
    BOOTSTRAP,
    bwrap_prefix,
    child_env,
    kill_uid,
    sandbox_capabilities,
    sandbox_slot,
    set_max_concurrency,
    uid_pool,
)

__all__ = ["PythonTool", "sandbox_capabilities", "set_max_concurrency"]


class PythonTool:
    """Runs Python code in a fresh sandboxed interpreter and returns what it printed."""

    name = "python"

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512, cpu_s: float | None = None,
                 max_output_chars: int = 10_000, max_procs: int = 32, max_file_mb: int = 64,
                 max_code_chars: int = 100_000, backend: str = "auto", echo_last_expr: bool = True,
                 require_network_isolation: bool = False, python_executable: str | None = None,
                 no_site: bool = False, uid_base: int = 62_000, scratch_root: str | None = None,
                 docker_image: str = "python:3.11-slim", reproducible_output: bool = True) -> None:
        """Configure the sandbox.

        Args:
            timeout_s: Wall-clock limit per call (the reference uses 120 s).
            memory_mb: Address-space limit (``RLIMIT_AS``).
            cpu_s: CPU-time limit; defaults to ``timeout_s + 1`` so that the wall-clock timeout (and its message)
                wins for single-threaded code, while multi-threaded CPU burners are still stopped.
            max_output_chars: Cap on the returned text; longer output is cut with a visible marker.
            max_procs: Process limit (``RLIMIT_NPROC``; enforced for the per-call uid when the host is root).
            max_file_mb: Largest file the code may write (``RLIMIT_FSIZE``).
            max_code_chars: Longer code is rejected without running.
            backend: ``"auto"`` (bwrap when installed, else subprocess), ``"subprocess"``, ``"bwrap"``, ``"docker"``.
            echo_last_expr: Print a final bare expression as a REPL would (reference behaviour).
            require_network_isolation: Raise ``ConfigError`` now if network isolation is unavailable.
            python_executable: Interpreter for the code (default: the current one; reference: a conda env).
            no_site: Also pass ``-S`` (no site-packages: stdlib only).
            uid_base: First uid of the per-call uid pool (root hosts only).
            scratch_root: Where scratch directories are created (default: the system temp dir).
            docker_image: Image for ``backend="docker"``.
            reproducible_output: Fixed hash seed and no address randomization in the child, so the same code prints
                the same text in every run (see the module docstring). False: ``python -I`` with randomization.
        """
        for key, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_output_chars", max_output_chars),
                           ("max_procs", max_procs), ("max_file_mb", max_file_mb), ("max_code_chars", max_code_chars)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"python tool setting '{key}' must be a positive number, got {value!r}")
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.cpu_s = float(cpu_s if cpu_s is not None else timeout_s + 1)
        self.max_output_chars, self.max_procs = int(max_output_chars), int(max_procs)
        self.max_file_mb, self.max_code_chars = int(max_file_mb), int(max_code_chars)
        self.echo_last_expr, self.no_site, self.uid_base = echo_last_expr, no_site, uid_base
        self.python_executable = python_executable or sys.executable
        self.scratch_root, self.docker_image = scratch_root, docker_image
        if not isinstance(reproducible_output, bool):
            raise ConfigError(f"python tool setting 'reproducible_output' must be true or false, got "
                              f"{reproducible_output!r}")
        self.reproducible_output = reproducible_output
        setarch = shutil.which("setarch") if reproducible_output else None
        self._no_aslr = [setarch, platform.machine(), "-R"] if setarch else []
        self.capabilities = sandbox_capabilities(backend)
        self.backend = self.capabilities["backend"]
        if not self.capabilities["available"]:
            raise ConfigError(f"python sandbox backend {backend!r} is unavailable: {self.capabilities['detail']}")
        if require_network_isolation and not self.capabilities["network_isolation"]:
            raise ConfigError("require_network_isolation=True but " + self.capabilities["detail"])

    def schema(self) -> dict:
        """OpenAI/Hermes function schema for the JSON tool-call protocol."""
        return function_schema(self.name, self.__call__)

    @tolerant_call
    def __call__(self, code: str) -> ToolResult:
        """Execute Python code in a fresh sandboxed interpreter; the printed output (or the traceback) is returned.

        Args:
            code: Python source. A final bare expression is printed, as in a REPL.
        """
        start = time.monotonic()
        problem = check_text_arg(code, "code", self.max_code_chars)
        if problem:
            return ToolResult(text=problem, error=True, meta={"invalid_arguments": True})
        with sandbox_slot():
            try:
                if self.backend == "docker":
                    result = self._run_docker(code)
                else:
                    result = self._run_process(code)
            except Exception as exc:  # sandbox infrastructure failure: reported, never raised into the rollout
                result = ToolResult(text=f"Python sandbox failure: {type(exc).__name__}: {exc}", error=True)
        result.latency_s = time.monotonic() - start
        result.meta.setdefault("network_isolated", self.capabilities["network_isolation"])
        result.meta["backend"] = self.backend
        return result

    def run_many(self, codes: list[str], max_workers: int = 8) -> list[ToolResult]:
        """Run several snippets concurrently (bounded by ``max_workers`` and the module-wide sandbox limit)."""
        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            return list(pool.map(lambda c: self(c), codes))

    # -- backends -------------------------------------------------------------------------------------------

    def _config(self, uid: int | None, code_file: str | None) -> dict[str, Any]:
        limits = {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_CPU": max(1, int(self.cpu_s + 0.999)),
                  "RLIMIT_FSIZE": self.max_file_mb << 20, "RLIMIT_CORE": 0, "RLIMIT_NOFILE": 256}
        net = self.capabilities["network_isolation"] and self.backend == "subprocess"
        # RLIMIT_NPROC counts all processes of a (user namespace, uid): only meaningful for the per-call uid, or
        # for a non-root host inside its own user namespace (kernel >= 5.14). The kernel never enforces it for root.
        if uid is not None or (net and os.geteuid() != 0):
            limits["RLIMIT_NPROC"] = self.max_procs
        return {"code_file": code_file, "net": net, "uid": uid, "limits": limits, "probe": False,
                "echo": self.echo_last_expr}

    def _run_process(self, code: str) -> ToolResult:
        uid = uid_pool(self.uid_base).get() if self.capabilities["uid_drop"] else None
        scratch = tempfile.mkdtemp(prefix="arpo-py-", dir=self.scratch_root)
        proc, collected = None, False
        try:
            if uid is not None:
                os.chown(scratch, uid, uid)
            prefix = bwrap_prefix(scratch) if self.backend == "bwrap" else []
            env = child_env(scratch)
            if self.reproducible_output:  # -I would ignore PYTHONHASHSEED; the environment is clean anyway
                flags, env["PYTHONHASHSEED"] = ["-s", "-P"], "0"
            else:
                flags = ["-I"]
            flags += ["-S"] if self.no_site else []
            cmd = [*prefix, *self._no_aslr, self.python_executable, *flags, "-c", BOOTSTRAP,
                   json.dumps(self._config(uid, None))]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=scratch, env=env, start_new_session=True)
            try:
                proc.stdin.write(code.encode("utf-8", "replace"))
                proc.stdin.close()
            except BrokenPipeError:
                pass
            out, err, status = self._collect(proc, uid)  # kills stragglers itself on every normal path
            collected = True
            return self._result(out, err, proc.returncode, status)
        finally:
            if proc is not None:
                if not collected:
                    self._kill(proc, uid)
                proc.wait()
                for stream in (proc.stdout, proc.stderr):
                    stream.close()
            shutil.rmtree(scratch, ignore_errors=True)
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
        keep = 4 * self.max_output_chars + 1024
        flood = max(1 << 20, 16 * self.max_output_chars)
        bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        total, status = 0, "ok"
        deadline = time.monotonic() + self.timeout_s
        exited_at = None
        with selectors.DefaultSelector() as sel:
            for stream in bufs:
                sel.register(stream, selectors.EVENT_READ)
            while sel.get_map():
                now = time.monotonic()
                if now > deadline:
                    status = "timeout"
                    break
                if exited_at is None and proc.poll() is not None:
                    exited_at = now  # stragglers holding the pipes must not stretch the call
                    self._kill(proc, uid)
                if exited_at is not None and now - exited_at > 1.0:
                    break
                for key, _ in sel.select(timeout=min(0.1, max(0.0, deadline - now))):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    total += len(chunk)
                    buf = bufs[key.fileobj]
                    if len(buf) < keep:
                        buf.extend(chunk[: keep - len(buf)])
                if total > flood:
                    status = "flood"
                    break
        if status == "ok":
            try:  # both pipes closed; the process may still be running (it closed them itself)
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                status = "timeout"
        self._kill(proc, uid)
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), status

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
        elif returncode == 121 and stderr.startswith("sandbox setup failed"):
            body = stderr
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

    def _run_docker(self, code: str) -> ToolResult:
        import docker  # optional dependency: pip install 'arpo[docker]'

        client = docker.from_env()
        scratch = tempfile.mkdtemp(prefix="arpo-py-", dir=self.scratch_root)
        try:
            with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            os.chmod(scratch, 0o777)
            cfg = self._config(None, "/scratch/main.py")
            container = client.containers.run(
                self.docker_image, ["python", "-I", "-c", BOOTSTRAP, json.dumps(cfg)], detach=True,
                network_disabled=True, mem_limit=f"{self.memory_mb}m", pids_limit=self.max_procs,
                read_only=True, user=f"{pwd.getpwnam('nobody').pw_uid}", working_dir="/scratch",
                volumes={scratch: {"bind": "/scratch", "mode": "rw"}}, environment=child_env("/scratch"))
            status = "ok"
            try:
                returncode = container.wait(timeout=self.timeout_s)["StatusCode"]
            except Exception:  # requests' ReadTimeout: the container ran past the limit
                container.kill()
                returncode, status = None, "timeout"
            out = container.logs(stdout=True, stderr=False)
            err = container.logs(stdout=False, stderr=True)
            container.remove(force=True)
            return self._result(out, err, returncode, status)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
