"""A pytest plugin (loaded by ``tests/conftest.py``): the suite fails when it ends with a child of the test process,
or of any process below it, left unreaped (a zombie), and names the zombie's parent and the first test after which it
was seen. Code that starts a process and never waits for it is a bug at its source; a zombie left by one test once
made a later test's process census fail, so the suite does not pass with one left behind."""

from __future__ import annotations

import pytest

from arpo_base.procs import unreaped

#: Zombie pid -> the test after which it was first seen (attribution only; the verdict is the census at the end).
_FIRST_SEEN: dict[int, str] = {}


@pytest.fixture(autouse=True)
def _note_unreaped_children(request):
    """After each test (its function-scoped fixtures torn down), note which zombies are below the test process."""
    yield
    for z in unreaped():
        _FIRST_SEEN.setdefault(z.pid, request.node.nodeid)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    left = unreaped()
    if not left:
        return
    lines = [
        f"{z}; first seen after {_FIRST_SEEN.get(z.pid, 'a fixture teardown at the end of the session')}" for z in left
    ]
    message = (
        "processes left unreaped at the end of the suite (each parent must wait for its child):\n  "
        + "\n  ".join(lines)
    )
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(message, red=True, bold=True)
    else:
        print(message)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
