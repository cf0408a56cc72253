"""The test command's exit status is the suite's result: a native crash after the last test has been reported (a
library's exit handler or static destructor) does not turn a passing run into a failure, and nothing else is hidden:
a failing test, a status pytest sets after the session (``--max-warnings``) and an error in a late hook still fail
the run, and a crash inside a test still kills it with its signal and stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: A native exit handler that jumps to an invalid address: what a library's static destructor or leftover thread
#: does when it crashes during the interpreter's teardown.
CRASH_AT_EXIT = "ctypes.CDLL(None).__cxa_atexit(ctypes.c_void_p(8), None, None)"


def _run(
    tmp_path: Path, body: str, hard_exit: bool, conftest: str = "", args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_cmdline_main  # noqa: F401\n" + conftest)
    (tmp_path / "test_case.py").write_text(f"import ctypes\nimport warnings\n\n\ndef test_case():\n    {body}\n")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHONFAULTHANDLER": "1",
        "ARPO_TEST_HARD_EXIT": "1" if hard_exit else "0",
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_case.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_crash_after_the_report_no_longer_fails_a_passing_run(tmp_path):
    crashed = _run(tmp_path, CRASH_AT_EXIT, hard_exit=False)
    assert crashed.returncode == -signal.SIGSEGV and "1 passed" in crashed.stdout  # what CI saw: all passed, then 139
    kept = _run(tmp_path, CRASH_AT_EXIT, hard_exit=True)
    assert kept.returncode == 0 and "1 passed" in kept.stdout, kept.stdout + kept.stderr


LATE_ERROR = "def pytest_terminal_summary(terminalreporter):\n    raise RuntimeError('late')\n"


@pytest.mark.parametrize(
    "body, conftest, args, status",
    [
        (f"{CRASH_AT_EXIT}; assert False", "", (), 1),  # a failure stays a failure
        ("warnings.warn('w')", "", ("--max-warnings", "0"), 6),  # a status set after the session
        (
            CRASH_AT_EXIT,
            "import pytest\n\n\ndef pytest_terminal_summary():\n    pytest.exit('stop', returncode=3)\n",
            (),
            3,
        ),  # pytest.exit in a summary hook
        ("pass", LATE_ERROR, (), 1),  # an error in a late hook: the usual exit
        ("ctypes.string_at(0)", "", (), -signal.SIGSEGV),  # a crash inside a test is not caught
    ],
    ids=["failure", "max-warnings", "exit-in-summary", "late-hook-error", "crash-in-test"],
)
def test_the_hard_exit_hides_no_failure(tmp_path, body, conftest, args, status):
    result = _run(tmp_path, body, hard_exit=True, conftest=conftest, args=args)
    assert result.returncode == status, result.stdout + result.stderr
    if status < 0:
        assert "Fatal Python error: Segmentation fault" in result.stderr and "test_case.py" in result.stderr
