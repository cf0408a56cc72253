"""The sandbox backends the isolation and limit tests run on, and the checks that skip (or, in CI, fail) a backend
this machine cannot run."""

from __future__ import annotations

import os
import shutil

import pytest

AS_ROOT = os.geteuid() == 0


def need_bwrap() -> None:
    """Skip without bubblewrap; fail instead where ARPO_REQUIRE_BWRAP=1, so CI never passes by skipping."""
    if shutil.which("bwrap") is None:
        if os.environ.get("ARPO_REQUIRE_BWRAP") == "1":
            pytest.fail("ARPO_REQUIRE_BWRAP=1 (CI) but bubblewrap is not installed: scripts/test installs it")
        pytest.skip("bubblewrap (bwrap) is not installed on this machine")


def need_docker() -> None:
    """Skip without a Docker engine holding the sandbox image; fail instead where ARPO_REQUIRE_DOCKER=1."""
    from arpo_env.tools.sandbox_docker import docker_backend_problem

    problem = docker_backend_problem()
    if problem:
        if os.environ.get("ARPO_REQUIRE_DOCKER") == "1":
            pytest.fail(
                f"ARPO_REQUIRE_DOCKER=1 (CI) but the Docker backend cannot run: {problem}; scripts/test "
                "installs the engine and builds the image"
            )
        pytest.skip(problem)


@pytest.fixture(scope="module", params=["subprocess", "bwrap", "docker"])
def backend(request) -> str:
    """Each sandbox backend in turn, skipped where this machine cannot run it (the subprocess backend isolates only
    as root, with a per-call uid; as another user it is refused)."""
    if request.param == "bwrap":
        need_bwrap()
    elif request.param == "docker":
        need_docker()
    elif not AS_ROOT:
        pytest.skip("the subprocess backend isolates only as root (per-call uid); as another user it is refused")
    return request.param
