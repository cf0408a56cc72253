"""The test command's exit status is the suite's result: a native crash after the last test has been reported (a
library's exit handler or static destructor) does not turn a passing run into a failure, and nothing else is hidden:
a failing test still fails the run, and a crash inside a test still kills it with its signal and stack."""

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


def _run(tmp_path: Path, body: str, hard_exit: bool) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_sessionfinish  # noqa: F401\n")
    (tmp_path / "test_case.py").write_text(f"import ctypes\n\n\ndef test_case():\n    {body}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1",
           "ARPO_TEST_HARD_EXIT": "1" if hard_exit else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_case.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_crash_after_the_report_no_longer_fails_a_passing_run(tmp_path):
    crashed = _run(tmp_path, CRASH_AT_EXIT, hard_exit=False)
    assert crashed.returncode == -signal.SIGSEGV and "1 passed" in crashed.stdout  # what CI saw: all passed, then 139
    kept = _run(tmp_path, CRASH_AT_EXIT, hard_exit=True)
    assert kept.returncode == 0 and "1 passed" in kept.stdout, kept.stdout + kept.stderr


@pytest.mark.parametrize("body, status", [
    (f"{CRASH_AT_EXIT}; assert False", 1),          # a failure stays a failure
    ("ctypes.string_at(0)", -signal.SIGSEGV),       # a crash inside a test is not caught
])
def test_the_hard_exit_hides_no_failure(tmp_path, body, status):
    result = _run(tmp_path, body, hard_exit=True)
    assert result.returncode == status, result.stdout + result.stderr
    if status < 0:
        assert "Fatal Python error: Segmentation fault" in result.stderr and "test_case.py" in result.stderr
