"""The image's seccomp profile: Docker's default plus only the namespace system calls (docker/seccomp_profile.py),
and a run command that grants no privilege. Docker itself does not run here; the profile's structure is checked."""

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
        "defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1,
        "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]}],
        "syscalls": [
            {"names": ["read", "write", "execve", "exit_group"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["clone", "mount", "setns", "umount2", "unshare"], "action": "SCMP_ACT_ALLOW",
             "includes": {"caps": ["CAP_SYS_ADMIN"]}},
            {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
             "args": [{"index": 0, "value": 2114060288, "op": "SCMP_CMP_MASKED_EQ"}],
             "excludes": {"caps": ["CAP_SYS_ADMIN"]}},
        ],
    }


def test_profile_adds_only_one_rule_of_namespace_calls(tmp_path):
    default = _default_like()
    src, out = tmp_path / "docker-default.json", tmp_path / "arpo-seccomp.json"
    src.write_text(json.dumps(default))
    subprocess.run([sys.executable, str(SCRIPT), str(src), str(out)], check=True)
    profile = json.loads(out.read_text())
    assert {k: v for k, v in profile.items() if k != "syscalls"} == {k: v for k, v in default.items()
                                                                     if k != "syscalls"}
    assert profile["syscalls"][:-1] == default["syscalls"]  # Docker's rules unchanged, in order
    added = profile["syscalls"][-1]
    assert set(added) == {"names", "action", "comment"} and added["action"] == "SCMP_ACT_ALLOW"
    assert set(added["names"]) <= NAMESPACE_CALLS and {"unshare", "clone"} <= set(added["names"])
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
