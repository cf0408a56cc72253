#!/usr/bin/env python3
"""Write the seccomp profile the arpo image needs for the Python tool's sandbox: Docker's default profile plus a rule
that allows the namespace system calls (``unshare``, ``clone`` with namespace flags, ``setns``, and for bubblewrap's
new root ``mount``, ``umount2``, ``pivot_root``) and one ``personality`` rule for the single value that reproducible
output sets (``ADDR_NO_RANDOMIZE``, through ``setarch -R``). Nothing else is added; no capability is granted.

Docker's default allows the namespace calls only to containers holding ``CAP_SYS_ADMIN``; the arpo image runs as a
non-root user without it, so the unprivileged user namespace that bubblewrap creates is refused. Inside such a
namespace the calls act only on the sandbox's own namespaces (the kernel checks capabilities there, not on the host).
Docker's default allows ``personality`` only for a few other values, so ``setarch -R`` fails without the second rule.

The profile is derived from the default of the engine in use, not stored here (so it cannot drift from it). Debian
ships that default inside the package ``golang-github-docker-docker-dev`` (built from the same source as
``docker.io``); the input may be that package's ``.deb`` file, read with ``dpkg-deb``, or the JSON itself::

    apt-get download golang-github-docker-docker-dev
    python docker/seccomp_profile.py golang-github-docker-docker-dev_*.deb arpo-seccomp.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

#: The system calls that creating and entering namespaces needs, and nothing else.
NAMESPACE_SYSCALLS = ("clone", "mount", "pivot_root", "setns", "umount2", "unshare")
RULE_COMMENT = "arpo: namespace system calls for the Python tool's sandbox (bubblewrap, unshare); no capability"
#: personality(PER_LINUX | ADDR_NO_RANDOMIZE): what ``setarch <arch> -R`` sets for reproducible output, and only that.
ADDR_NO_RANDOMIZE = 0x0040000
PERSONALITY_COMMENT = "arpo: personality(ADDR_NO_RANDOMIZE) for reproducible output (setarch -R); no other value"
#: Where Debian's golang-github-docker-docker-dev keeps the engine's default profile.
DEB_MEMBER = "/profiles/seccomp/default.json"


def namespace_rule() -> dict:
    """The one rule this profile adds to Docker's default."""
    return {"names": list(NAMESPACE_SYSCALLS), "action": "SCMP_ACT_ALLOW", "comment": RULE_COMMENT}


def personality_rule() -> dict:
    """The rule for the one ``personality`` value that reproducible output sets."""
    return {
        "names": ["personality"],
        "action": "SCMP_ACT_ALLOW",
        "args": [{"index": 0, "value": ADDR_NO_RANDOMIZE, "op": "SCMP_CMP_EQ"}],
        "comment": PERSONALITY_COMMENT,
    }


def check_default(profile: dict) -> None:
    """Refuse anything that does not look like Docker's default: deny by default, a list of rules, no rule of ours."""
    if not isinstance(profile, dict) or profile.get("defaultAction") != "SCMP_ACT_ERRNO":
        raise ValueError("not Docker's default seccomp profile: defaultAction must be SCMP_ACT_ERRNO")
    rules = profile.get("syscalls")
    if not isinstance(rules, list) or not all(
        isinstance(r, dict) and isinstance(r.get("names"), list) and isinstance(r.get("action"), str) for r in rules
    ):
        raise ValueError("not Docker's default seccomp profile: 'syscalls' must be a list of {names, action} rules")
    if any(r.get("comment") in (RULE_COMMENT, PERSONALITY_COMMENT) for r in rules):
        raise ValueError("the input already holds the arpo rule: give Docker's default, not this script's output")


def with_namespaces(default: dict) -> dict:
    """Docker's ``default`` profile with :func:`namespace_rule` and :func:`personality_rule` appended (the input is
    not changed)."""
    check_default(default)
    profile = json.loads(json.dumps(default))
    profile["syscalls"] += [namespace_rule(), personality_rule()]
    return profile


def read_default(path: str) -> dict:
    """Docker's default profile from ``path``: a JSON file, or Debian's ``golang-github-docker-docker-dev`` package
    (its data read through ``dpkg-deb --fsys-tarfile``; nothing of it is run)."""
    if not path.endswith(".deb"):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", path], stdout=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(DEB_MEMBER):
                    return json.load(tar.extractfile(member))
    finally:
        proc.stdout.close()
        proc.wait()
    raise ValueError(f"{path} holds no *{DEB_MEMBER}: not Debian's golang-github-docker-docker-dev package")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: seccomp_profile.py DOCKER_DEFAULT.json|golang-github-docker-docker-dev_VERSION.deb OUTPUT.json",
            file=sys.stderr,
        )
        return 2
    profile = with_namespaces(read_default(argv[0]))
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
