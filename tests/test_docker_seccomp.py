"""The image's seccomp profile: Docker's default plus only the namespace system calls and one personality value
(docker/seccomp_profile.py), and a run command that grants no privilege; with an engine, the documented run starts
the tool with bwrap inside a container (the profile read from Debian's golang-github-docker-docker-dev package)."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "docker" / "seccomp_profile.py"
DOCS = REPO / "docs" / "sandbox.md"
NAMESPACE_CALLS = {"unshare", "clone", "setns", "mount", "umount2", "pivot_root"}


def _module():
    spec = importlib.util.spec_from_file_location("seccomp_profile", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _default_like() -> dict:
    """The shape of Docker's default: deny by default, plain rules, and the namespace calls only with CAP_SYS_ADMIN."""
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]}],
        "syscalls": [
            {"names": ["read", "write", "execve", "exit_group"], "action": "SCMP_ACT_ALLOW"},
            {
                "names": ["clone", "mount", "setns", "umount2", "unshare"],
                "action": "SCMP_ACT_ALLOW",
                "includes": {"caps": ["CAP_SYS_ADMIN"]},
            },
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": 2114060288, "op": "SCMP_CMP_MASKED_EQ"}],
                "excludes": {"caps": ["CAP_SYS_ADMIN"]},
            },
        ],
    }


def test_profile_adds_only_the_namespace_calls_and_one_personality_value(tmp_path):
    default = _default_like()
    src, out = tmp_path / "docker-default.json", tmp_path / "arpo-seccomp.json"
    src.write_text(json.dumps(default))
    subprocess.run([sys.executable, str(SCRIPT), str(src), str(out)], check=True)
    profile = json.loads(out.read_text())
    assert {k: v for k, v in profile.items() if k != "syscalls"} == {
        k: v for k, v in default.items() if k != "syscalls"
    }
    assert profile["syscalls"][:-2] == default["syscalls"]  # Docker's rules unchanged, in order
    added, personality = profile["syscalls"][-2:]
    assert set(added) == {"names", "action", "comment"} and added["action"] == "SCMP_ACT_ALLOW"
    assert set(added["names"]) <= NAMESPACE_CALLS and {"unshare", "clone"} <= set(added["names"])
    # personality for exactly one value: PER_LINUX | ADDR_NO_RANDOMIZE (setarch -R)
    assert personality["names"] == ["personality"] and personality["action"] == "SCMP_ACT_ALLOW"
    assert personality["args"] == [{"index": 0, "value": 0x0040000, "op": "SCMP_CMP_EQ"}]
    assert json.loads(src.read_text()) == default  # the input is not changed


def test_profile_refuses_what_is_not_dockers_default(tmp_path):
    mod = _module()
    allow_all = dict(_default_like(), defaultAction="SCMP_ACT_ALLOW")
    with pytest.raises(ValueError, match="defaultAction"):
        mod.with_namespaces(allow_all)
    with pytest.raises(ValueError, match="already holds the arpo rule"):
        mod.with_namespaces(mod.with_namespaces(_default_like()))
    broken = copy.deepcopy(_default_like())
    broken["syscalls"][0]["names"] = "read"
    with pytest.raises(ValueError, match="syscalls"):
        mod.with_namespaces(broken)


def test_image_ships_bwrap_and_the_documented_run_command_grants_no_privilege():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"apt-get install[^\n]*\n[^\n]*\bbubblewrap\b", dockerfile)
    assert "USER arpo" in dockerfile
    docs = DOCS.read_text()
    commands = [line for line in docs.splitlines() if "docker run" in line]
    assert commands and all("--security-opt seccomp=" in line for line in commands)
    for line in (dockerfile + docs).splitlines():
        if "docker run" in line or "--security-opt" in line or "--cap-add" in line:
            assert "--privileged" not in line and "SYS_ADMIN" not in line and "--cap-add" not in line, line


# Run inside the container by the image's own python, with the checkout and this environment's packages mounted
# read-only: the tool must choose bwrap, reach "filesystem" and keep reproducible output (ADDR_NO_RANDOMIZE set).
INSIDE = (
    "import json, os\nfrom arpo_env.tools.python_tool import PythonTool\nt = PythonTool(timeout_s=20)\n"
    "r = t(\"import os\\nprint(os.getuid(), open('/proc/self/personality').read().strip())\")\n"
    "print(json.dumps({'uid': os.getuid(), 'backend': t.backend, 'level': t.isolation['level'],"
    " 'reproducible': t.reproducible_output, 'out': r.text, 'error': r.error}))"
)


def test_bwrap_starts_in_a_container_with_the_profile_derived_from_debians_package(tmp_path):
    """The documented run (non-root user, the derived profile, apparmor/systempaths unconfined) starts the tool at
    level "filesystem" with bwrap and reproducible output on. Before: Docker's default forbids the personality value
    that `setarch -R` sets, and every backend failed to start."""
    import os
    import shutil
    import sysconfig

    from arpo_env.tools.sandbox_docker import DEFAULT_IMAGE, USER_ID, docker_backend_problem

    deb = os.environ.get("ARPO_DOCKER_PROFILE_DEB")
    problem = docker_backend_problem() or (None if shutil.which("docker") else "the docker command is missing")
    if not problem and not (deb and os.path.isfile(deb)):
        problem = (
            "no golang-github-docker-docker-dev package (ARPO_DOCKER_PROFILE_DEB names it; "
            "`apt-get download golang-github-docker-docker-dev`)"
        )
    if problem:
        if os.environ.get("ARPO_REQUIRE_DOCKER") == "1":
            pytest.fail(f"ARPO_REQUIRE_DOCKER=1 (CI) but {problem}; scripts/test sets it up")
        pytest.skip(problem)
    profile = tmp_path / "arpo-seccomp.json"
    subprocess.run([sys.executable, str(SCRIPT), deb, str(profile)], check=True)
    site = sysconfig.get_paths()["purelib"]
    cmd = [
        "docker",
        "run",
        "--rm",
        "--user",
        f"{USER_ID}:{USER_ID}",
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--network",
        "none",
        "--security-opt",
        f"seccomp={profile}",
        "--security-opt",
        "apparmor=unconfined",
        "--security-opt",
        "systempaths=unconfined",
        "-v",
        f"{REPO}:/src:ro",
        "-v",
        f"{site}:/site:ro",
        "-e",
        "PYTHONPATH=/src:/site",
        "-e",
        "HOME=/tmp",
        DEFAULT_IMAGE,
        "python",
        "-c",
        INSIDE,
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    assert facts == {
        "uid": USER_ID,
        "backend": "bwrap",
        "level": "filesystem",
        "reproducible": True,
        "out": f"{USER_ID} 00040000",
        "error": False,
    }, facts
