"""What a call can consume and who controls the uid pool, on this machine's real kernel: memory written through the
sandbox's /tmp, a fork flood, a full scratch folder, several processes each near the memory limit, user namespaces
inside the sandbox, and a lock folder or symbolic link planted by another user.

bwrap tests need bubblewrap, docker tests an engine holding the sandbox image (``arpo sandbox build-image``); with
ARPO_REQUIRE_BWRAP=1 and ARPO_REQUIRE_DOCKER=1 (set by scripts/test in CI) they fail instead of skipping."""

from __future__ import annotations

import os
import shutil

import pytest

from arpo_env.tools.python_tool import PythonTool
from arpo_env.tools.sandbox import SandboxError, UidLeases, call_cgroups_available
from tests.arpo_env.conftest import AS_ROOT

MIB = 1 << 20


# Writes 1 MiB blocks to `path` until an error stops it; prints how many MiB made it and what stopped it.
FILL = (
    "import os\nn = 0\nblock = os.urandom(1 << 20)\ntry:\n    with open({path!r}, 'wb', buffering=0) as f:\n"
    "        while n < {limit}:\n            f.write(block); n += 1\nexcept OSError as e:\n"
    "    print('stopped', e.strerror)\nprint('wrote', n)"
)


def _written(result) -> int:
    lines = (result.text + "\n" + result.meta.get("stdout", "")).splitlines()
    return max([int(line.split()[1]) for line in lines if line.startswith("wrote ")], default=0)


@pytest.mark.parametrize("where", ["/tmp/fill", "/dev/shm/fill", "fill"])
def test_writing_is_bounded_in_every_writable_folder(backend, where):
    """/tmp, /dev/shm and the scratch folder are each a tmpfs of disk_mb: a write stops there (before: /tmp and
    /dev/shm were half the RAM each, the scratch folder the host's disk with only a per-file cap)."""
    tool = PythonTool(timeout_s=20, backend=backend, memory_mb=256, max_file_mb=512, disk_mb=32)
    result = tool(FILL.format(path=where, limit=200))
    assert "stopped No space left on device" in result.text, result.text
    assert 16 <= _written(result) <= 32, result.text
    assert tool("print('still fine')").text == "still fine"


def test_tmp_counts_against_the_memory_limit(backend):
    """With a cgroup per call, what the code keeps in its tmpfs folders is memory of the call: a /tmp larger than
    the memory limit still cannot hold more than the limit (before: 960 MiB fit under a 512 MiB limit)."""
    if backend != "docker" and not (AS_ROOT and call_cgroups_available()):
        pytest.skip("no cgroup v1 memory controller for the calls here; /tmp is bounded by its size alone")
    tool = PythonTool(timeout_s=20, backend=backend, memory_mb=96, max_file_mb=512, disk_mb=400)
    assert tool.isolation["resource_limits"].startswith("the container's" if backend == "docker" else "cgroup v1")
    result = tool(FILL.format(path="/tmp/fill", limit=300))
    assert result.error and _written(result) < 96, result.text


def test_processes_share_one_memory_limit(backend):
    """Eight processes each touching 48 MiB under a 128 MiB limit: the call's processes together stay under it
    (before: each process had its own address-space limit, eight times the memory)."""
    if backend != "docker" and not (AS_ROOT and call_cgroups_available()):
        pytest.skip("no cgroup v1 memory controller for the calls here; each process has its own RLIMIT_AS")
    tool = PythonTool(timeout_s=20, backend=backend, memory_mb=128)
    code = (
        "import os, time\nkids = []\nfor i in range(8):\n    pid = os.fork()\n    if pid == 0:\n"
        "        b = bytearray(48 << 20)\n        for j in range(0, len(b), 4096): b[j] = 1\n"
        "        time.sleep(1); os._exit(0)\n    kids.append(pid)\nok = 0\nfor pid in kids:\n"
        "    _, status = os.waitpid(pid, 0)\n    ok += status == 0\nprint('survived', ok)"
    )
    result = tool(code)
    survived = [int(line.split()[1]) for line in result.text.splitlines() if line.startswith("survived ")]
    assert not survived or survived[0] * 48 < 128, result.text


def test_a_fork_flood_stops_at_the_cap(backend):
    """Processes that keep forking (and keep living): the call never holds more than max_procs processes."""
    tool = PythonTool(timeout_s=20, backend=backend, max_procs=12)
    code = (
        "import os, time\nn = 1\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('stopped', e)\n"
        "print('processes', n)"
    )
    result = tool(code)
    assert "stopped" in result.text and "Resource temporarily unavailable" in result.text, result.text
    n = int(result.text.split("processes ")[1].split()[0])
    assert 2 <= n <= 12, result.text
    assert tool("print('still fine')").text == "still fine"


def test_no_user_namespace_inside(backend):
    tool = PythonTool(timeout_s=20, backend=backend)
    result = tool(
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))\n"
        "print(os.system('unshare -U true 2>/dev/null') != 0)"
    )
    assert result.text.splitlines() == ["-1 Operation not permitted", "True"], result.text
    assert tool.isolation["attempts"]["create a user namespace"] == "Operation not permitted"


def _runtime(tmp_path) -> str:
    os.chmod(tmp_path, 0o755)
    return str(tmp_path / "arpo")


def test_the_uid_pool_refuses_a_planted_lock_folder(tmp_path):
    """A local user who made the lock folder first (theirs, or open to all) neither holds nor redirects the locks."""
    if not AS_ROOT:
        pytest.skip("the uid pool is used as root only")
    runtime = _runtime(tmp_path)
    UidLeases(62_000, size=2, runtime_dir=runtime)  # made by us: accepted
    locks = os.path.join(runtime, "sandbox-uids")
    os.chown(locks, 65534, 65534)
    with pytest.raises(SandboxError, match="owned by uid 65534"):
        UidLeases(62_000, size=2, runtime_dir=runtime)
    os.chown(locks, 0, 0)
    os.chmod(locks, 0o1777)
    with pytest.raises(SandboxError, match="mode 1777"):
        UidLeases(62_000, size=2, runtime_dir=runtime)
    shutil.rmtree(runtime)
    os.chmod(tmp_path, 0o777)  # the parent open to all, not sticky: anyone could swap the folder
    with pytest.raises(SandboxError, match="writable by no one else"):
        UidLeases(62_000, size=2, runtime_dir=runtime)


def test_the_uid_pool_refuses_symbolic_links(tmp_path):
    if not AS_ROOT:
        pytest.skip("the uid pool is used as root only")
    runtime = _runtime(tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    os.symlink(target, runtime)
    with pytest.raises(SandboxError, match="not a folder"):
        UidLeases(62_000, size=2, runtime_dir=runtime)
    os.unlink(runtime)
    pool = UidLeases(62_000, size=1, runtime_dir=runtime)
    victim = tmp_path / "victim"
    os.symlink(victim, os.path.join(runtime, "sandbox-uids", "62000.lock"))
    with pytest.raises(SandboxError, match="cannot be opened safely"):
        pool.get()
    assert not victim.exists()


# Starts the setuid-root program `su`, waits for its first words (its password prompt, or that it knows no root user
# where the sandbox has no /etc/passwd): it has started then, and its status keeps its credentials until it is reaped.
SETUID = (
    "import shutil, subprocess\nsu = shutil.which('su') or '/bin/su'\n"
    "p = subprocess.Popen([su, 'root', '-c', 'id'], stdin=subprocess.PIPE, stdout=subprocess.PIPE,"
    " stderr=subprocess.PIPE)\nprint('said', p.stderr.read(4).decode())\n"
    "with open('/proc/%d/status' % p.pid) as f:\n"
    "    print(''.join(l for l in f if l.startswith(('Uid:', 'CapEff:', 'CapBnd:', 'NoNewPrivs:'))))\n"
    "p.kill()\np.wait()\nprint('reaped')"
)


def test_a_setuid_program_gains_nothing(backend):
    """`su` (setuid root) started by the code keeps the code's uid and no capability (no_new_privs); a container's
    bounding set is empty as well (before: the default capability set, with no no-new-privileges option)."""
    tool = PythonTool(timeout_s=20, backend=backend)
    result = tool(SETUID)
    assert result.text.startswith(("said Pass", "said su: ")) and "reaped" in result.text, result.text  # su ran
    status = dict(line.split(":", 1) for line in result.text.splitlines()[1:] if ":" in line)
    assert status["Uid"].split()[1] != "0" and status["NoNewPrivs"].strip() == "1", result.text
    assert int(status["CapEff"], 16) == 0, result.text
    if backend == "docker":
        assert int(status["CapBnd"], 16) == 0, result.text
