"""The Docker sandbox image: the Debian source it is built from (read from apt's configuration), the command that
builds it (reusing an image already there), and what ``arpo doctor`` says about it.

The build itself runs in CI through the same command (scripts/test builds the image when missing) and the whole
hostile battery then runs against it (test_sandbox_isolation.py, test_sandbox_limits.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from arpo_base.errors import ConfigError
from arpo_env.tools.sandbox_docker import DEFAULT_IMAGE, debian_source, docker_backend_problem, image_status

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _apt(tmp_path, sources: dict[str, str], codename: str = "bookworm") -> tuple[str, str]:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    for name, text in sources.items():
        (apt / name).write_text(text)
    release = tmp_path / "os-release"
    release.write_text(f'PRETTY_NAME="Debian GNU/Linux 12"\nVERSION_CODENAME={codename}\n')
    return str(apt), str(release)


def test_the_mirror_comes_from_apts_own_sources(tmp_path):
    deb822 = (
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\nTypes: deb-src deb\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main contrib\nSigned-By: /usr/share/keyrings/k.gpg\n"
    )
    assert debian_source(*_apt(tmp_path, {"sources.list.d/debian.sources": deb822})) == (
        "http://mirror.example/debian",
        "bookworm",
    )
    one_line = "# old style\ndeb [arch=amd64 signed-by=/k.gpg] http://other.example/debian bookworm main\n"
    # sources.list comes first, as apt reads it; a disabled file (not .list/.sources) is not read
    found = debian_source(
        *_apt(
            tmp_path / "b",
            {
                "sources.list": one_line,
                "sources.list.d/debian.sources": deb822,
                "sources.list.d/x.list.disabled": "deb http://no/ bookworm main",
            },
        )
    )
    assert found == ("http://other.example/debian", "bookworm")


def test_no_source_for_this_release_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no apt source .* serves 'trixie main'") as err:
        debian_source(*_apt(tmp_path, {"sources.list": "deb http://m.example/debian bookworm main\n"}, "trixie"))
    assert "--mirror" in err.value.hint


def _docker_ready() -> None:
    problem = docker_backend_problem()
    if problem:
        if os.environ.get("ARPO_REQUIRE_DOCKER") == "1":
            pytest.fail(f"ARPO_REQUIRE_DOCKER=1 (CI) but the Docker backend cannot run: {problem}")
        pytest.skip(problem)


def test_build_image_reuses_the_image_and_doctor_reports_it():
    _docker_ready()
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run(
        [sys.executable, "-m", "arpo_algo.cli.main", "sandbox", "build-image", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.splitlines()[-1])
    assert (info["image"], info["built"]) == (DEFAULT_IMAGE, False) and info["size_mb"] > 10, info
    assert "already in the local engine" in out.stdout
    from arpo_algo.cli.doctor import doctor_report

    assert (
        doctor_report()["docker_sandbox_image"]
        == image_status()
        == {"image": DEFAULT_IMAGE, "present": True, "detail": "in the local engine"}
    )


def test_the_docker_backend_defaults_to_the_versioned_image():
    from arpo_env.tools.python_tool import PythonTool
    from arpo_env.tools.sandbox_docker import IMAGE_NAME, RECIPE

    assert DEFAULT_IMAGE == f"{IMAGE_NAME}:{RECIPE}" and RECIPE.startswith("v")
    _docker_ready()
    assert PythonTool(backend="docker").docker_image == DEFAULT_IMAGE


def test_a_failed_build_is_one_clear_error_and_leaves_nothing_behind():
    """debootstrap failing (a mirror nothing answers at) ends the command with its last lines and a hint, no
    traceback; no work folder and no image are left."""
    _docker_ready()
    import shutil

    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        if os.environ.get("ARPO_REQUIRE_DOCKER") == "1":
            pytest.fail("ARPO_REQUIRE_DOCKER=1 (CI) but the image cannot be built here (root and debootstrap)")
        pytest.skip("building the image needs root and debootstrap")
    before = {p for p in os.listdir("/var/tmp") if p.startswith("arpo-sandbox-image-")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "arpo_algo.cli.main",
            "sandbox",
            "build-image",
            "--tag",
            "arpo-sandbox:unreachable-mirror",
            "--mirror",
            "http://127.0.0.1:9/debian",
            "--suite",
            "bookworm",
        ],
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "error: debootstrap failed" in out.stderr, out.stderr
    assert "hint: check the mirror" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert {p for p in os.listdir("/var/tmp") if p.startswith("arpo-sandbox-image-")} == before
    assert docker_backend_problem("arpo-sandbox:unreachable-mirror") is not None  # no image of that tag
