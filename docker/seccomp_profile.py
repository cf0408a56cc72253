#!/usr/bin/env python3
"""Write the seccomp profile the arpo image needs for the Python tool's sandbox: Docker's default profile plus ONE
rule that allows the namespace system calls (``unshare``, ``clone`` with namespace flags, ``setns``, and for
bubblewrap's new root ``mount``, ``umount2``, ``pivot_root``). Nothing else is added; no capability is granted.

Docker's default allows these calls only to containers holding ``CAP_SYS_ADMIN``; the arpo image runs as a
non-root user without it, so the unprivileged user namespace that bubblewrap creates is refused. Inside such a
namespace the calls act only on the sandbox's own namespaces (the kernel checks capabilities there, not on the host).

The profile is derived from the Docker version in use (its default is not stored here, so it cannot drift from the
engine): see docs/sandbox.md for the run command::

    curl -fsSLo docker-default.json \\
        https://raw.githubusercontent.com/moby/moby/master/profiles/seccomp/default.json
    python docker/seccomp_profile.py docker-default.json arpo-seccomp.json
"""

from __future__ import annotations

import json
import sys

#: The system calls that creating and entering namespaces needs, and nothing else.
NAMESPACE_SYSCALLS = ("clone", "mount", "pivot_root", "setns", "umount2", "unshare")
RULE_COMMENT = "arpo: namespace system calls for the Python tool's sandbox (bubblewrap, unshare); no capability"


def namespace_rule() -> dict:
    """The one rule this profile adds to Docker's default."""
    return {"names": list(NAMESPACE_SYSCALLS), "action": "SCMP_ACT_ALLOW", "comment": RULE_COMMENT}


def check_default(profile: dict) -> None:
    """Refuse anything that does not look like Docker's default: deny by default, a list of rules, no rule of ours."""
    if not isinstance(profile, dict) or profile.get("defaultAction") != "SCMP_ACT_ERRNO":
        raise ValueError("not Docker's default seccomp profile: defaultAction must be SCMP_ACT_ERRNO")
    rules = profile.get("syscalls")
    if not isinstance(rules, list) or not all(isinstance(r, dict) and isinstance(r.get("names"), list)
                                              and isinstance(r.get("action"), str) for r in rules):
        raise ValueError("not Docker's default seccomp profile: 'syscalls' must be a list of {names, action} rules")
    if any(r.get("comment") == RULE_COMMENT for r in rules):
        raise ValueError("the input already holds the arpo rule: give Docker's default, not this script's output")


def with_namespaces(default: dict) -> dict:
    """Docker's ``default`` profile with :func:`namespace_rule` appended (the input is not changed)."""
    check_default(default)
    profile = json.loads(json.dumps(default))
    profile["syscalls"].append(namespace_rule())
    return profile


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: seccomp_profile.py DOCKER_DEFAULT.json OUTPUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        profile = with_namespaces(json.load(f))
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
