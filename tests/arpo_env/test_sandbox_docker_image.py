"""The Docker backend against an image that is not the sandbox's own: a CPU quota bounds the call, the image's
ENTRYPOINT does not wrap the sandbox's command, and its declared VOLUMEs leave nothing on the host (each is a private
tmpfs). Needs a Docker engine holding the sandbox image (CI: ``ARPO_REQUIRE_DOCKER=1``); the derived image is built
from it locally, without a registry."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest

from arpo_env.tools.python_tool import PythonTool
from arpo_env.tools.sandbox_docker import DEFAULT_IMAGE, docker_client
from tests.arpo_env.conftest import need_docker

DOCKERFILES = {
    "entrypoint": f'FROM {DEFAULT_IMAGE}\nENTRYPOINT ["/bin/sh", "-c", "echo hijacked; exit 3"]\nCMD ["ignored"]\n',
    "volume": f'FROM {DEFAULT_IMAGE}\nVOLUME ["/data"]\n',
}

CPU_CODE = """
import os
V1 = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us")
if os.path.exists("/sys/fs/cgroup/cpu.max"):
    quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
else:
    name = next(n for n in V1 if os.path.exists(n))
    quota, period = open(name).read().strip(), open(name.replace("quota", "period")).read().strip()
print("max" if quota in ("max", "-1") else int(quota) / int(period))
"""
VOLUME_CODE = """
import os
open("/data/MARKER", "w").write("x")
st = os.statvfs("/data")
print(st.f_blocks * st.f_frsize <= 64 << 20)
"""


@pytest.fixture(scope="module")
def images():
    """The sandbox image with a hostile ENTRYPOINT, and with a declared VOLUME (built locally, removed after)."""
    need_docker()
    client = docker_client()
    tags = {}
    try:
        for kind, text in DOCKERFILES.items():
            tag = f"arpo-test-{kind}:{uuid.uuid4().hex[:12]}"
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "Dockerfile"), "w") as f:
                    f.write(text)
                client.images.build(path=d, tag=tag, rm=True, pull=False)
            tags[kind] = tag
        yield tags
    finally:
        for tag in tags.values():
            client.images.remove(tag, force=True)
        client.close()


def test_a_call_gets_one_cpu_at_most():
    need_docker()
    result = PythonTool(backend="docker", timeout_s=60)(CPU_CODE)
    assert result.text.strip() != "max" and float(result.text) <= 1.0, result.text


def test_an_images_entrypoint_does_not_wrap_the_sandboxs_command(images):
    result = PythonTool(backend="docker", docker_image=images["entrypoint"], timeout_s=60)("print(6 * 7)")
    assert result.text.strip() == "42" and "hijacked" not in result.text, result.text


def test_an_images_declared_volume_leaves_nothing_on_the_host(images):
    client = docker_client()
    try:
        before = {v.name for v in client.volumes.list()}
        tool = PythonTool(backend="docker", docker_image=images["volume"], timeout_s=60, disk_mb=64)
        result = tool(VOLUME_CODE)
        assert result.text.strip() == "True", result.text  # /data is a tmpfs of disk_mb, not a volume on disk
        new = {v.name for v in client.volumes.list()} - before
        assert not new, f"volumes left on the host: {new}"
    finally:
        client.close()
