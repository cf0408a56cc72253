"""A served request that finds no persistent Python interpreter free (the process's ``max_interpreters``, or the
request's share of them) answers 503 ``interpreters_exhausted`` with a message, never a 500: real sandboxes."""

from __future__ import annotations

import shutil
import threading

import pytest

from arpo_env.session import ToolSession
from arpo_env.tools.interpreter import REQUEST_SHARE, InterpretersExhausted, live_interpreters
from arpo_env.tools.python_tool import PythonTool
from serve.runtime import EngineFailure, ServeSession, run_failure
from serve.schema import APIError


def test_exhausted_interpreters_are_a_503_not_a_500():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed on this machine")
    tool = PythonTool(backend="bwrap", persistent=True, timeout_s=5, max_interpreters=REQUEST_SHARE)  # 1 per request
    request = threading.Event()
    sessions = [
        ServeSession(ToolSession(tools={"python": tool}, max_tool_calls=4, max_turns=8), [], False, request)
        for _ in range(2)
    ]
    try:
        assert sessions[0].step("<python>print(1)</python>").tool_output.strip() == "1"
        with pytest.raises(InterpretersExhausted):
            sessions[1].step("<python>print(2)</python>")
        err = run_failure(sessions, ["session step failed: InterpretersExhausted(...)"])
        assert isinstance(err, APIError) and err.status == 503, err
        assert err.body()["error"]["code"] == "interpreters_exhausted" and "retry" in err.message
        # any other failure stays a server fault
        assert isinstance(run_failure(sessions[:1], ["engine error"]), EngineFailure)
    finally:
        for s in sessions:
            s.inner.close()
    assert live_interpreters() == 0
