"""The sandbox against the host: what the model's code must not read, reach or write, per backend, on this machine's
real kernel; the refusal below the minimum level; a broken sandbox raises instead of returning an observation.

bwrap tests need bubblewrap, docker tests an engine holding the sandbox image (``arpo sandbox build-image``); with
ARPO_REQUIRE_BWRAP=1 and ARPO_REQUIRE_DOCKER=1 (set by scripts/test in CI) they fail instead of skipping."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from arpo_base.errors import ConfigError
from arpo_env.session import ToolSession
from arpo_env.tools.isolation_checks import require_env_python_isolation, require_python_isolation
from arpo_env.tools.python_tool import PythonTool
from arpo_env.tools.sandbox import SandboxError
from tests.arpo_env.conftest import AS_ROOT, need_bwrap

SECRET = "arpo-host-secret-4d1f"


@pytest.fixture(scope="module")
def tool(backend) -> PythonTool:
    return PythonTool(timeout_s=10, backend=backend)


@pytest.fixture()
def host_dir():
    """A folder others may enter, outside the sandbox's scratch and outside /tmp (which every backend replaces by a
    private one anyway), removed afterwards."""
    path = tempfile.mkdtemp(prefix="arpo-host-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _write(path: str, mode: int) -> str:
    with open(path, "w") as f:
        f.write(SECRET)
    os.chmod(path, mode)
    return path


def _assert_denied(result, *errors: str) -> None:
    assert result.error and SECRET not in result.text and SECRET not in result.meta.get("stdout", ""), result
    assert any(e in result.text for e in errors), result.text


def test_level_meets_the_minimum(tool):
    assert tool.isolation["level"] in ("process", "filesystem") and tool.isolation["network_isolation"]
    assert tool.isolation["separate_user"] or tool.isolation["private_filesystem"]
    if tool.backend == "bwrap":
        assert tool.isolation["level"] == "filesystem"


def test_cannot_read_a_root_only_file(tool, host_dir):
    if not AS_ROOT:
        pytest.skip("needs root to create a file only root can read")
    path = _write(os.path.join(host_dir, "secret.txt"), 0o600)
    _assert_denied(tool(f"print(open({path!r}).read())"), "PermissionError", "FileNotFoundError")


def test_cannot_read_another_users_file(tool, host_dir):
    if not AS_ROOT:
        pytest.skip("needs root to create a file of another user")
    path = _write(os.path.join(host_dir, "theirs.txt"), 0o600)
    os.chown(path, 4242, 4242)  # a uid outside the sandbox pool
    _assert_denied(tool(f"print(open({path!r}).read())"), "PermissionError", "FileNotFoundError")


def test_cannot_read_inside_a_root_only_folder(tool, host_dir):
    if not AS_ROOT:
        pytest.skip("needs root to create a folder only root can enter")
    inner = os.path.join(host_dir, "private")
    os.mkdir(inner, 0o700)
    path = _write(os.path.join(inner, "notes.txt"), 0o644)
    _assert_denied(tool(f"print(open({path!r}).read())"), "PermissionError", "FileNotFoundError")


def test_cannot_read_another_process_environment(tool):
    env = {**os.environ, "ARPO_SECRET": SECRET}
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        code = f"print(open('/proc/{other.pid}/environ', 'rb').read())"
        _assert_denied(tool(code), "PermissionError", "FileNotFoundError")
        _assert_denied(
            tool(f"print(open('/proc/{os.getpid()}/environ', 'rb').read())"), "PermissionError", "FileNotFoundError"
        )
        listed = tool(
            f"import os\nprint(os.path.exists('/proc/{other.pid}'))\nprint(open('/proc/{other.pid}/cmdline').read())"
        )
        assert listed.error and "False" in listed.meta["stdout"] and "time.sleep" not in listed.text, listed
    finally:
        other.kill()
        other.wait()


def test_cannot_read_arpo_home(tool):
    home = os.environ["ARPO_HOME"]  # the suite's own ARPO_HOME (tests/conftest.py)
    os.makedirs(home, exist_ok=True)
    path = _write(os.path.join(home, "token.txt"), 0o644)
    try:
        _assert_denied(tool(f"print(open({path!r}).read())"), "PermissionError", "FileNotFoundError")
    finally:
        os.unlink(path)


def test_cannot_connect_to_a_local_port(tool):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        result = tool(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host's listener
    finally:
        server.close()
    # bwrap's own loopback is up (refused: nothing listens in there); the bootstrap's is down (unreachable).
    assert result.error and "connected" not in result.text, result.text
    assert "Network is unreachable" in result.text or "Connection refused" in result.text, result.text


def test_cannot_write_outside_scratch(tool, host_dir):
    os.chmod(host_dir, 0o1777)  # writable by anyone on the host
    targets = [os.path.join(host_dir, "x"), "/var/tmp/arpo-sandbox-write-test", "/dev/shm/arpo-sandbox-write-test"]
    code = (
        "\n".join(
            f"try:\n    open({t!r}, 'w').write('x')\nexcept OSError as e:\n    print(type(e).__name__)" for t in targets
        )
        + "\nopen('here.txt', 'w').write('ok')\nprint(open('here.txt').read())"
    )
    result = tool(code)
    try:
        assert not result.error and result.text.splitlines()[-1] == "ok", result.text
        assert not [t for t in targets if os.path.exists(t)]  # none reached the host
    finally:
        for t in targets:
            if os.path.exists(t):
                os.unlink(t)


def test_private_tmp(tool):
    host_tmp = tempfile.mkdtemp(prefix="arpo-host-tmp-", dir="/tmp")
    os.chmod(host_tmp, 0o755)
    code = (
        f"import os\nprint(os.path.exists({host_tmp!r}))\nopen('/tmp/mine.txt', 'w').write('mine')\n"
        "open('/dev/shm/mine.txt', 'w').write('mine')\nprint(open('/tmp/mine.txt').read())"
    )
    try:
        result = tool(code)
    finally:
        os.rmdir(host_tmp)
    assert (result.error, result.text) == (False, "False\nmine"), result.text
    assert not os.path.exists("/tmp/mine.txt") and not os.path.exists("/dev/shm/mine.txt")


@pytest.mark.parametrize("backend", ["bwrap", "subprocess"])
def test_an_environment_under_tmp(tmp_path, backend):
    """An interpreter whose environment lives under /tmp runs in the sandbox (its folders are bound after the private
    /tmp), and the code sees that environment as its sys.prefix."""
    if backend == "bwrap":
        need_bwrap()
    elif not AS_ROOT:
        pytest.skip("the subprocess backend isolates only as root")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    os.chmod(tmp_path, 0o755)  # pytest's folders are 0700: the sandbox uid must be able to enter the environment
    os.chmod(tmp_path.parent, 0o755)
    tool = PythonTool(timeout_s=10, backend=backend, python_executable=str(venv / "bin" / "python"))
    result = tool("import sys\nprint(sys.prefix)\nprint(6 * 7)")
    assert (result.error, result.text) == (False, f"{venv}\n42"), result.text


def _system_python() -> str:
    """An interpreter under /usr, which any uid can run without a mount namespace."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand) and subprocess.run([cand, "-c", "import ctypes"], capture_output=True).returncode == 0:
            return cand
    pytest.skip("no system python3 with ctypes under /usr")


def test_downgrade_is_refused_without_the_opt_in(caplog):
    """Without namespaces the code would reach the network: refused, by the tool and by the start-up check, unless
    the caller opts in, which then gets the level it really has (and the network, which it gave up)."""
    spec = {"backend": "subprocess", "namespaces": False, "python_executable": _system_python(), "timeout_s": 10}
    with pytest.raises(ConfigError, match="no network isolation") as exc:
        PythonTool(**spec)
    assert "allow_unisolated_python" in exc.value.hint
    with pytest.raises(ConfigError, match="no network isolation"):
        PythonTool(**spec, allow_unisolated_python=True, require_network_isolation=True)
    with pytest.raises(ConfigError, match="below the minimum 'process'") as exc:
        require_python_isolation(spec, context="serve")
    assert "--allow-unisolated-python" in exc.value.hint
    with caplog.at_level(logging.WARNING, logger="arpo_env.tools.isolation_checks"):
        record = require_python_isolation(spec, allow_unisolated_python=True, context="test-downgrade")
        require_python_isolation(spec, allow_unisolated_python=True, context="test-downgrade")
    assert record["level"] == "unisolated" and record["allowed_unisolated"] and not record["network_isolation"]
    assert len([r for r in caplog.records if "UNISOLATED" in r.message]) == 1  # warned once
    tool = PythonTool(**spec, allow_unisolated_python=True)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:  # the level is stated truthfully: this sandbox does reach the host's loopback
        result = tool(
            f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}))\nprint('connected')"
        )
    finally:
        server.close()
    assert (result.text, result.meta["isolation_level"]) == ("connected", "unisolated")


def test_env_config_check_carries_the_opt_in_to_the_workers():
    spec = {"backend": "subprocess", "namespaces": False, "python_executable": _system_python()}
    with pytest.raises(ConfigError, match="below the minimum"):
        require_env_python_isolation({"task": "toolmath", "tools": {"python": dict(spec)}})
    env = {"task": "toolmath", "tools": {"python": dict(spec)}}
    record = require_env_python_isolation(env, allow_unisolated_python=True)
    assert record["level"] == "unisolated" and env["tools"]["python"]["allow_unisolated_python"] is True
    PythonTool(**env["tools"]["python"])  # what a rollout worker builds from it is accepted
    assert require_env_python_isolation({"task": "toolmath", "tools": {"search": {}}}) is None
    default = require_env_python_isolation({"task": "toolmath"})  # the task's default tools include python
    assert default is not None and default["meets_minimum"]


def test_a_broken_sandbox_raises_instead_of_returning_an_observation(tmp_path):
    """The self-test refuses a backend that cannot run anything; a failure during a call raises SandboxError."""
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises((ConfigError, SandboxError), match="cannot start|failed"):
        PythonTool(backend="subprocess", python_executable=str(broken))
    tool = PythonTool(timeout_s=10, backend="subprocess" if AS_ROOT else "auto")
    tool._no_aslr = [shutil.which("false")]  # the launcher in front of the interpreter fails, as setarch can
    with pytest.raises(SandboxError, match="failed to start"):
        tool("print('never')")
    tool._no_aslr = [str(tmp_path / "missing-launcher")]
    with pytest.raises(SandboxError, match="FileNotFoundError|not found|No such file"):
        tool("print('never')")
    session = ToolSession(tools={"python": {"timeout_s": 10}})
    session.tools = {**session.tools, "python": tool}  # a copy: tool sets are shared between sessions
    with pytest.raises(SandboxError):
        session._run_tool(type("Call", (), {"tool": "python", "args": {"code": "print(1)"}})(), _Step())


class _Step:
    latency_s = cache_hit = tool_error = tool_output = tool_meta = None


def test_model_code_exiting_121_is_an_observation(tool):
    """The model cannot make its own failure look like a sandbox failure (the READY mark comes first)."""
    result = tool("import sys\nsys.stderr.write('sandbox setup failed: fake\\n')\nsys.exit(121)")
    assert result.error and "fake" in result.text


def test_doctor_reports_the_level():
    from arpo_algo.cli.doctor import doctor_report

    sandbox = doctor_report()["python_tool_sandbox"]
    expected = PythonTool().isolation
    assert (sandbox["level"], sandbox["backend"]) == (expected["level"], expected["backend"])
    assert sandbox["minimum"] == "process" and sandbox["meets_minimum"] == (expected["level"] != "unisolated")


def test_bwrap_keeps_the_process_limit():
    """As root bwrap runs without a user namespace; the per-call uid keeps RLIMIT_NPROC, which stops a fork bomb."""
    need_bwrap()
    if not AS_ROOT:
        pytest.skip("as another user bwrap's user namespace carries the limit; this checks the per-call uid")
    tool = PythonTool(timeout_s=3, max_procs=8, backend="bwrap")
    result = tool("import os\nwhile True:\n    os.fork()")
    assert result.error and "Resource temporarily unavailable" in result.text, result.text
    assert tool("print('still fine')").text == "still fine"


def test_a_user_namespace_without_a_mapped_uid_is_unisolated(tmp_path):
    """As another user the subprocess backend's user namespace maps no uid: getuid() reads 65534 inside, but the
    kernel treats the code as this user, and the self-test's attempts read its 0600 file and the file in its 0700
    folder. Rated unisolated and refused (before: "process", accepted, while the code could append to ~/.bashrc)."""
    if AS_ROOT:
        pytest.skip("as root calls get their own uid; test_the_battery_as_an_unprivileged_user runs this as uid 4243")
    with pytest.raises(ConfigError, match="below the minimum 'process'"):
        PythonTool(timeout_s=10, backend="subprocess")
    tool = PythonTool(timeout_s=10, backend="subprocess", allow_unisolated_python=True)
    attempts = tool.isolation["attempts"]
    assert tool.isolation["level"] == "unisolated" and not tool.isolation["separate_user"], tool.isolation
    assert attempts["read a 0600 file of the server's user"] == "read", attempts
    assert attempts["read a file in a 0700 folder of the server's user"] == "read", attempts
    mine = _write(str(tmp_path / "mine.txt"), 0o600)
    assert tool(f"print(open({mine!r}).read())").text == SECRET  # what the level says: the code is this user


def _as_nobody(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    setpriv = shutil.which("setpriv") or "setpriv"
    return subprocess.run(
        [setpriv, "--reuid=4243", "--regid=4243", "--clear-groups", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(__file__),
    )


def test_the_battery_as_an_unprivileged_user(tmp_path):
    """The hostile battery again as uid 4243 (setpriv; an ordinary uid, not the overflow uid 65534): with bwrap
    every test must pass (level filesystem), and without bwrap on the PATH the tool must refuse, whatever it is
    asked. Fails, never skips, when the checkout or the environment is unreadable to that uid."""
    if not AS_ROOT:
        pytest.skip("switching to another uid needs root; this run already is unprivileged")
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to run the battery as an unprivileged user")
    need_bwrap()
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    os.chmod(tmp_path, 0o1777)
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": repo,
        "LC_ALL": "C.UTF-8",
        "ARPO_REQUIRE_BWRAP": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    # Through /bin/sh: the interpreter is looked up and run with that uid's rights, as the tool will run it.
    probe = _as_nobody(
        [
            "/bin/sh",
            "-c",
            f'exec "$0" -c "import arpo_env.tools.python_tool, pytest, os; os.listdir({here!r})"',
            sys.executable,
        ],
        env,
        120,
    )
    if probe.returncode != 0:
        pytest.fail(
            "uid 4243 cannot read the checkout or the environment (the battery must run as an "
            f"unprivileged user): {probe.stderr.strip()[-800:]}"
        )
    battery = _as_nobody(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow",
            os.path.join(here, "test_sandbox_isolation.py"),
            os.path.join(here, "test_sandbox_limits.py"),
            "-k",
            "not unprivileged_user",
            "-rs",
        ],
        env,
        600,
    )
    assert battery.returncode == 0, battery.stdout[-4000:] + battery.stderr[-2000:]
    # Without bwrap: a PATH holding only the interpreter; the subprocess backend's unmapped user namespace is refused.
    bare = tmp_path / "bin"
    bare.mkdir()
    os.symlink(sys.executable, bare / "python")
    refused = _as_nobody(
        [
            sys.executable,
            "-c",
            (
                "from arpo_base.errors import ConfigError\n"
                "from arpo_env.tools.python_tool import PythonTool\n"
                "for backend in ('auto', 'subprocess', 'bwrap'):\n"
                "    try:\n        PythonTool(timeout_s=10, backend=backend)\n        print(backend, 'ACCEPTED')\n"
                "    except ConfigError as e:\n        print(backend, 'refused:', e.message.splitlines()[0])\n"
            ),
        ],
        {**env, "PATH": str(bare)},
        120,
    )
    lines = refused.stdout.splitlines()
    assert refused.returncode == 0 and len(lines) == 3 and all(" refused: " in line for line in lines), (
        refused.stdout + refused.stderr
    )
    assert "below the minimum 'process'" in lines[0] and "bwrap is not installed" in lines[2], lines
