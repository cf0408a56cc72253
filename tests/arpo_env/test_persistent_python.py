"""Persistent Python interpreters (``tools.python.persistent``): state kept between calls, forks at branch points, and
the sandbox's rules kept: real sandboxes, real forks, on this machine's kernel.

bwrap is required in CI (ARPO_REQUIRE_BWRAP=1: fail instead of skip); the subprocess backend isolates only as root."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from arpo_base.errors import ArpoError, ConfigError
from arpo_env.core import ToolTextEnv
from arpo_env.session import ToolSession
from arpo_env.tools import build_tools
from arpo_env.tools.interpreter import ForkError, interpreter_metrics, live_interpreters, sample_interpreter_memory
from arpo_env.tools.python_tool import PythonTool
from arpo_env.tools.sandbox import SandboxError, ToolCancelled, cancel_scope


def _need_bwrap() -> None:
    if shutil.which("bwrap") is None:
        if os.environ.get("ARPO_REQUIRE_BWRAP") == "1":
            pytest.fail("ARPO_REQUIRE_BWRAP=1 (CI) but bubblewrap is not installed")
        pytest.skip("bubblewrap (bwrap) is not installed on this machine")


@pytest.fixture(scope="module", params=["bwrap", "subprocess"])
def tool(request) -> PythonTool:
    if request.param == "bwrap":
        _need_bwrap()
    elif os.geteuid() != 0:
        pytest.skip("the subprocess backend isolates only as root")
    return PythonTool(backend=request.param, persistent=True, timeout_s=3, max_interpreters=16, fork_copy_mb=4)


@pytest.fixture(scope="module", autouse=True)
def private_tmp(tmp_path_factory):
    """The module's sandboxes make their scratch folders in a temp dir of their own, so the leftover check below
    counts only this module's folders, never those of other jobs on the machine (a training run's interpreters)."""
    import tempfile

    tmp_path_factory.getbasetemp()  # pytest's own temp root is fixed first, outside the folder removed below
    root = tempfile.mkdtemp(prefix="arpo-test-tmp-")
    os.chmod(root, 0o711)  # sandbox uids traverse it to reach their own scratch folder, and list nothing
    saved, tempfile.tempdir = tempfile.tempdir, root
    try:
        yield root
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leftovers(private_tmp):
    """Every test ends with no live interpreter, no process of a sandbox uid and no scratch folder of its own."""
    before = set(_scratch_dirs())
    yield
    assert live_interpreters() == 0
    assert _sandbox_processes() == []
    assert set(_scratch_dirs()) - before == set()


def _sandbox_processes(lo: int = 62_000, hi: int = 62_256) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line[:4] in ("Stat", "Uid:"))
            if lo <= int(fields["Uid"].split()[0]) < hi and not fields["State"].strip().startswith(("Z", "X")):
                found.append(int(entry))
        except (OSError, KeyError, ValueError):
            continue
    return found


def _scratch_dirs() -> list[str]:
    import tempfile

    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("arpo-py-")]


def _session(tool: PythonTool) -> ToolSession:
    return ToolSession(tools={"python": tool}, max_tool_calls=20, max_turns=40)


def _run(session: ToolSession, code: str) -> str:
    st = session.step(f"<python>{code}</python>")
    assert st.kind == "tool", st
    return st.tool_output.strip()


def test_state_persists_across_calls(tool):
    s = _session(tool)
    assert _run(s, "import math\nx = 40\n_ = open('n.txt', 'w').write('2')") == "(no output)"
    assert _run(s, "x + int(open('n.txt').read())") == "42"
    assert _run(s, "math.sqrt(x + 9)") == "7.0"
    s.close()


def test_siblings_start_from_the_parent_and_never_see_each_other(tool):
    s = _session(tool)
    _run(s, "d = {'v': 1}\nopen('f.txt', 'w').write('parent')")
    a, b = s.clone(), s.fork()
    assert _run(a, "d['v'] = 2\nopen('f.txt', 'w').write('A')\nprint(d['v'], open('f.txt').read())") == "2 A"
    assert _run(b, "print(d['v'], open('f.txt').read())") == "1 parent"
    _run(b, "d['w'] = 'b'\nopen('g.txt', 'w').write('B')")
    assert _run(a, "import os\nprint(sorted(d), os.path.exists('g.txt'))") == "['v'] False"
    assert _run(s, "import os\nprint(d, open('f.txt').read(), os.path.exists('g.txt'))") == "{'v': 1} parent False"
    for x in (s, a, b):
        x.close()


def test_fork_with_an_open_file_and_a_large_array(tool):
    s = _session(tool)
    _run(
        s,
        "big = bytearray(range(256)) * (40 << 12)\nw = open('log.txt', 'w')\nw.write('head;')\n"
        "open('data.txt', 'w').write('0123456789')\nr = open('data.txt')\nr.read(3)",
    )
    a, b = s.clone(), s.clone()
    # Each child's descriptors point at its own copy: its own offset, its own content, the parent's unflushed buffer.
    assert (
        _run(a, "w.write('A'); w.flush()\nprint(r.read(2), len(big), big[-1], open('log.txt').read())")
        == "34 41943040 255 head;A"
    )
    assert _run(b, "w.write('B'); w.flush()\nprint(r.read(2), big[12345], open('log.txt').read())") == "34 57 head;B"
    assert _run(s, "w.flush()\nprint(r.read(), open('log.txt').read())") == "3456789 head;"
    for x in (s, a, b):
        x.close()


@pytest.mark.parametrize(
    "end", ["import time\ntime.sleep(30)", "import os\nos._exit(3)", "import ctypes\nctypes.string_at(0)"]
)
def test_a_branch_that_times_out_or_crashes_leaves_the_others_working(tool, end):
    s = _session(tool)
    _run(s, "x = 7")
    a, b = s.clone(), s.clone()
    st = a.step(f"<python>{end}</python>")
    assert st.tool_error and "the next call starts a fresh interpreter" in st.tool_output, st.tool_output
    assert st.tool_meta["interpreter_lost"] is True
    assert _run(b, "x * 6") == "42" and _run(s, "x") == "7"
    # The model was told; its next call runs in a fresh interpreter (not a silent one: it has no x).
    assert "NameError" in _run(a, "x")
    for x in (s, a, b):
        x.close()


def test_nothing_survives_the_trajectory(tool):
    """A daemon that leaves the process group and double-forks ends with its trajectory (checked by the fixture),
    at the trajectory's end (an answer), reset and close."""
    daemon = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(300)\n"
        "    os._exit(0)\nprint('started')"
    )
    env = ToolTextEnv(task="toolmath", tools={"python": tool}, max_tool_calls=8)
    env.reset(seed=0)
    assert "started" in env.step(f"<python>{daemon}</python>")[0]
    child = env.fork()
    assert "started" in child.step(f"<python>{daemon}</python>")[0]
    assert _sandbox_processes()
    env.step("<answer>\\boxed{1}</answer>")  # the trajectory ends: its interpreter too; the branch lives on
    assert "7" in child.step("<python>print(3 + 4)</python>")[0]
    child.reset(seed=1)
    assert live_interpreters() == 0
    s = _session(tool)
    _run(s, daemon)
    s.reset()


def test_a_cancelled_call_ends_its_interpreter(tool):
    s = _session(tool)
    _run(s, "x = 1")
    event = threading.Event()
    threading.Timer(0.5, event.set).start()
    t0 = time.monotonic()
    with cancel_scope(event), pytest.raises(ToolCancelled):
        s.step("<python>import time\ntime.sleep(30)</python>")
    assert time.monotonic() - t0 < 4
    assert live_interpreters() == 0


def test_one_trajectory_cannot_read_another_trajectorys_state(tool):
    a, b = _session(tool), _session(tool)
    where = _run(a, "import os\nsecret = 'arpo-secret-91'\nopen('s.txt', 'w').write(secret)\nprint(os.getcwd())")
    probe = (
        f"import os\nfound = []\ntry:\n    found.append(open({where + '/s.txt'!r}).read())\nexcept OSError as e:\n"
        "    found.append(type(e).__name__)\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    try:\n        found.append(open(f'/proc/{pid}/cmdline').read())\n    except OSError:\n        pass\n"
        "print(any('arpo-secret-91' in f for f in found), found[0])"
    )
    assert _run(b, probe).startswith("False ")
    a.close()
    b.close()


def test_fork_that_cannot_be_made_is_an_error_for_that_trajectory(tool):
    s = _session(tool)
    _run(s, "open('big.bin', 'wb').write(b'x' * (5 << 20))\ny = 1")
    with pytest.raises(ForkError, match="more than"):
        s._interps["python"].fork()
    child = s.clone()  # a tree's clone never raises: the one trajectory fails at its next call
    with pytest.raises(ForkError):
        child.step("<python>print(y)</python>")
    assert _run(s, "y") == "1"  # the parent is untouched
    s.close()
    child.close()


def test_live_interpreters_are_capped(tool):
    capped = PythonTool(backend=tool.backend, persistent=True, max_interpreters=2)
    s = _session(capped)
    _run(s, "z = 1")
    c = s.clone()
    with pytest.raises(ForkError, match="max_interpreters"):
        c.clone().step("<python>z</python>")
    s.close()
    c.close()


def test_a_fork_that_cannot_be_made_is_counted():
    """A fork refused by the live-interpreter cap counts in rollout/interpreter_forks_failed (and no fork is made)."""
    _need_bwrap()
    interpreter_metrics()  # start from a clean count
    tool = PythonTool(backend="bwrap", persistent=True, max_interpreters=1)
    interp = tool.open_interpreter()
    try:
        assert interp(code="x = list(range(10**6))").error is False
        assert sample_interpreter_memory() > 20 << 20  # a million ints: well over 20 MB, counted
        with pytest.raises(ForkError):
            interp.fork()
    finally:
        interp.close()
    assert sample_interpreter_memory() == 0 and live_interpreters() == 0
    metrics = interpreter_metrics()
    assert metrics["rollout/interpreter_forks_failed"] == 1 and metrics["rollout/interpreter_forks"] == 0
    assert metrics["rollout/interpreter_pss_mib_peak"] > 20


def test_refusals_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="docker backend") as exc:
        PythonTool(backend="docker", persistent=True)
    assert exc.value.hint
    with pytest.raises(ConfigError, match="persistent"):
        PythonTool(backend="subprocess", persistent="yes", allow_unisolated_python=True)
    _need_bwrap()
    with pytest.raises(ArpoError, match="trajectory's interpreter"):
        PythonTool(backend="bwrap", persistent=True)("print(1)")
    with pytest.raises(ConfigError, match="cache"):
        build_tools({"python": {"backend": "bwrap", "persistent": True}, "cache": {"path": str(tmp_path / "c.sqlite")}})
    assert isinstance(SandboxError("x"), ArpoError)


def test_the_sandbox_holds_in_a_persistent_interpreter_and_its_forks(tool, tmp_path_factory):
    """The stateless battery's core attempts, from a persistent interpreter and from a fork of it: a 0600 host file,
    the host's 127.0.0.1, a new user namespace."""
    import socket

    folder = tmp_path_factory.mktemp("host", numbered=True)
    os.chmod(folder, 0o755)
    secret = folder / "secret"
    secret.write_text("arpo-host-secret-77")
    os.chmod(secret, 0o600)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    attempts = (
        f"import ctypes, os, socket\nout = []\ntry:\n    out.append(open({str(secret)!r}).read())\n"
        "except OSError as e:\n    out.append(type(e).__name__)\ntry:\n"
        f"    socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=2)\n"
        "    out.append('connected')\nexcept OSError as e:\n    out.append(type(e).__name__)\n"
        "out.append(ctypes.CDLL(None).unshare(0x10000000))\nprint(out)"
    )
    s = _session(tool)
    fork = None
    try:
        texts = [_run(s, attempts)]
        fork = s.clone()
        assert _run(fork, "len(out)") == "3"  # a fork of s's interpreter (it has s's names), not a fresh one
        texts.append(_run(fork, attempts))
        for text in texts:
            assert "arpo-host-secret-77" not in text and "connected" not in text and text.endswith("-1]"), text
    finally:
        listener.close()
        s.close()
        if fork is not None:
            fork.close()


def test_a_forged_reply_on_the_control_socket_ends_only_that_interpreter(tool):
    """The code can find its control socket; what it writes there is data: the call ends, the host goes on."""
    s = _session(tool)
    _run(s, "x = 5")
    sibling = s.clone()
    forge = (
        "import os, socket\nfor fd in range(3, 64):\n    try:\n        sk = socket.socket(fileno=os.dup(fd))\n"
        "        sk.sendall(b'\\x00\\x00\\x00\\x05junk!')\n    except OSError:\n        pass"
    )
    st = s.step(f"<python>{forge}</python>")
    assert st.tool_error and st.tool_meta["interpreter_lost"], st.tool_output
    assert _run(sibling, "x") == "5"
    s.close()
    sibling.close()


# ---------------------------------------------------------------- the control channel is hostile input
def _forge(payload: str) -> str:
    """Model code that writes ``payload`` (a bytes expression) to every socket it can reach (its control socket)."""
    return (
        "import os, socket\nfor fd in range(3, 64):\n    try:\n        sk = socket.socket(fileno=os.dup(fd))\n"
        f"        sk.sendall({payload})\n    except OSError:\n        pass"
    )


@pytest.mark.parametrize(
    "payload",
    [
        "b'\\xff\\xff\\xff\\xf0' + b'x' * 100",  # a forged length header: 4 GiB promised
        "b'\\x00\\x10\\x00\\x00' + b'{' * (1 << 20)",  # a whole 1 MiB message, above the 64 KiB cap
    ],
)
def test_a_forged_or_huge_control_message_ends_the_interpreter_at_once(tool, payload):
    s = _session(tool)
    _run(s, "x = 5")
    sibling = s.clone()
    t0 = time.monotonic()
    st = s.step(f"<python>{_forge(payload)}</python>")
    assert time.monotonic() - t0 < tool.timeout_s, "the host waited for bytes the header promised"
    assert st.tool_error and st.tool_meta["interpreter_lost"] and st.tool_meta["channel_broken"], st.tool_output
    assert "variables, imports and files are lost" in st.tool_output
    assert _run(s, "'x' in globals()") == "False"  # a fresh interpreter
    assert _run(sibling, "x") == "5"
    s.close()
    sibling.close()


def test_a_process_left_writing_to_the_channel_cannot_hang_a_fork_or_close(tool):
    """A process the call left behind (in the interpreter's group, not a thread) trickles a forged header onto the
    control socket while the host forks: the fork fails within its deadline, the interpreter ends, close() returns."""
    s = _session(tool)
    code = (
        "import os, socket, time\nif os.fork() == 0:\n    time.sleep(0.3)\n    for fd in range(3, 64):\n"
        "        try:\n            sk = socket.socket(fileno=os.dup(fd))\n"
        "            sk.sendall(b'\\x00\\x00\\xf0\\x00')\n"
        "            for _ in range(600):\n                sk.sendall(b' ')\n                time.sleep(0.1)\n"
        "        except OSError:\n            pass\n    os._exit(0)\ny = 1"
    )
    assert _run(s, code) == "(no output)"
    time.sleep(0.6)  # the forged header is on the socket
    t0 = time.monotonic()
    child = s.clone()
    with pytest.raises(ForkError):
        child.step("<python>print(y)</python>")
    st = s.step("<python>y</python>")
    assert st.tool_meta["interpreter_lost"] and "lost" in st.tool_output, st.tool_output
    s.close()
    child.close()
    assert time.monotonic() - t0 < 30


def test_a_call_that_leaves_a_thread_running_ends_its_interpreter(tool):
    s = _session(tool)
    for start in (
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()",
        "import _thread, time\n_thread.start_new_thread(time.sleep, (60,))",
    ):
        _run(s, "kept = 1")
        st = s.step(f"<python>{start}\nprint('started')</python>")
        assert "started" in st.tool_output and "thread" in st.tool_output, st.tool_output
        assert st.tool_meta["interpreter_lost"] and st.tool_meta["thread_left"], st.tool_meta
        assert _run(s, "'kept' in globals()") == "False"
    # a thread joined before the call returns is fine
    assert (
        _run(s, "import threading\nt = threading.Thread(target=print, args=('hi',))\nt.start()\nt.join()\ndone = 1")
        == "hi"
    )
    assert _run(s, "t.is_alive()") == "False"
    s.close()


def test_one_request_may_hold_only_its_share_of_the_interpreters(tool):
    from arpo_env.tools.interpreter import REQUEST_SHARE, InterpretersExhausted

    capped = PythonTool(backend=tool.backend, persistent=True, max_interpreters=2 * REQUEST_SHARE)
    request, other = threading.Event(), threading.Event()
    held = []
    with cancel_scope(request):
        for _ in range(2):
            held.append(_session(capped))
            _run(held[-1], "1")
        extra = _session(capped)
        with pytest.raises(InterpretersExhausted, match="the most one request may"):
            extra.step("<python>1</python>")
    with cancel_scope(other):  # another request still gets its own
        held.append(_session(capped))
        _run(held[-1], "1")
    for s in (*held, extra):
        s.close()


DRAW = "print(random.random(), random.randrange(10**9), np.random.rand(), np.random.randint(10**9))"


def _seeded(tool: PythonTool, seed: int) -> ToolSession:
    s = _session(tool)
    s.seed_tools(seed)
    return s


def test_a_fork_draws_what_a_replay_of_its_parents_calls_draws(tool):
    """A seeded root seeds random and numpy (imported after the start); a branch continues its parent's state, so
    it draws what a replay of the parent's calls in a new interpreter with the same seed draws next."""
    s = _seeded(tool, 7)
    early = s.fork()  # forked before anything ran: it starts as its parent does
    first = _run(s, "import random\nimport numpy as np\n" + DRAW)
    a, b = s.fork(), s.clone()
    nxt = _run(a, DRAW)
    assert _run(b, DRAW) == nxt  # siblings: each is the same replay
    assert _run(s, DRAW) == nxt  # the parent itself draws the same next
    replay = _seeded(tool, 7)
    assert _run(replay, "import random\nimport numpy as np\n" + DRAW) == first  # two runs, one seed
    assert _run(replay, DRAW) == nxt
    assert _run(early, "import random\nimport numpy as np\n" + DRAW) == first
    other = _seeded(tool, 8)
    assert _run(other, "import random\nimport numpy as np\n" + DRAW) != first
    for x in (s, a, b, replay, early, other):
        x.close()


def test_a_root_seeds_numpy_already_imported_and_unseeded_roots_differ(tool):
    s, t = _seeded(tool, 3), _seeded(tool, 3)
    for x in (s, t):
        _run(x, "import numpy as np, random")
    assert _run(s, DRAW) == _run(t, DRAW)
    u, v = _session(tool), _session(tool)  # no seed: the OS's randomness, as before
    assert _run(u, "import random\nprint(random.random())") != _run(v, "import random\nprint(random.random())")
    for x in (s, t, u, v):
        x.close()
