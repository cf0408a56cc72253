"""The Docker sandbox backend: its containers (:func:`run_container`) and its image, built without any registry: a
``debootstrap --variant=minbase`` root from the machine's own Debian package sources (the mirror named in its apt
configuration) holding ``python3``, ``python-is-python3`` and ``bubblewrap``, imported into the local engine under a
versioned tag that ``PythonTool(backend="docker")`` uses by default (``arpo sandbox build-image``).

The tag's version is the recipe's: it changes whenever what goes into the image changes, so an image built by an
older recipe is never taken for the current one. Users with a registry can still name any image that has ``python``
on its PATH (``tools.python.docker_image``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from arpo_base.errors import ConfigError
from arpo_env.tools.pipes import output_limits
from arpo_env.tools.sandbox import SandboxError, cancel_event

#: Bumped whenever the packages, the user or the settings below change.
RECIPE = "v1"
IMAGE_NAME = "arpo-sandbox"
DEFAULT_IMAGE = f"{IMAGE_NAME}:{RECIPE}"
BUILD_COMMAND = "arpo sandbox build-image"
PACKAGES = ("python3", "python-is-python3", "bubblewrap")
#: A non-root user inside the image, for running bubblewrap in a container (docs/sandbox.md).
USER, USER_ID = "arpo", 1000
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Where a call's code is inside its container (a read-only mount of a folder holding only that file).
CODE_FILE = "/code/main.py"
#: The CPUs one call's container may use at once (Docker's CPU quota): a call's processes and threads together get
#: one core's time, never every core of the host.
CONTAINER_CPUS = 1.0
_OWN_MOUNTS = ("/scratch", "/tmp", "/dev/shm", os.path.dirname(CODE_FILE))


def docker_client():
    """A client of the local Docker engine; SandboxError saying what is missing (the package, the engine)."""
    try:
        import docker  # optional dependency: pip install 'arpo[docker]'

        from_env = docker.from_env  # type: ignore[attr-defined]  # mypy sees the repository's docker/ folder
    except (ImportError, AttributeError) as exc:  # AttributeError: a folder named docker/ shadows the package
        raise SandboxError("the docker Python package is not importable", hint="pip install 'arpo[docker]'") from exc
    try:
        client = from_env()
        client.ping()
    except Exception as exc:
        raise SandboxError(
            f"no Docker engine answers ({type(exc).__name__}: {str(exc)[:200]})",
            hint="start the engine (dockerd, `systemctl start docker`) or set DOCKER_HOST",
        ) from exc
    return client


def image_present(client, image: str) -> bool:
    import docker.errors

    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False


def require_image(client, image: str) -> None:
    """SandboxError naming how to get ``image`` when the engine does not hold it (never an implicit pull)."""
    if image_present(client, image):
        return
    if image == DEFAULT_IMAGE:
        hint = f"build it from this machine's Debian package sources: {BUILD_COMMAND}"
    else:
        hint = f"pull or build it (`docker pull {image}`), or use the default image {DEFAULT_IMAGE} ({BUILD_COMMAND})"
    raise SandboxError(f"the Docker sandbox image {image!r} is not in the local engine", hint=hint)


def run_container(
    image: str,
    command: list[str],
    code: str,
    *,
    memory_mb: int,
    max_procs: int,
    disk_mb: int,
    timeout_s: float,
    max_output_chars: int,
    environment: dict[str, str],
    scratch_root: str | None = None,
    check_image: bool = False,
) -> tuple[bytes, bytes, int | None, str]:
    """Run ``command`` in a fresh container of ``image`` with ``code`` at :data:`CODE_FILE`; return its stdout,
    stderr, exit code and status: "ok"; or "timeout", "cancelled", "flood" with the container killed and code None.

    The container has no network, no capability, no_new_privs, a read-only root, ``memory_mb`` without swap (tmpfs
    pages count), ``max_procs`` for all its processes and :data:`CONTAINER_CPUS` of CPU, and private tmpfs of
    ``disk_mb`` for ``/scratch`` (its working folder, ``nobody``'s), ``/tmp``, ``/dev/shm`` and every ``VOLUME`` the
    image declares (so no volume is made on the host's disk); it runs ``command`` whatever the image's
    ``ENTRYPOINT`` says, as ``nobody``, and is removed afterwards with any volume it has. Its
    output is read as it comes, as the other backends read theirs: the engine keeps no log of it on the host's disk,
    at most ``4 x max_output_chars`` bytes of each stream are kept, and a container writing more than
    ``max(1 MiB, 16 x max_output_chars)`` bytes is stopped."""
    import docker.types

    client = docker_client()
    container, codedir = None, tempfile.mkdtemp(prefix="arpo-py-", dir=scratch_root)
    try:
        if check_image:
            require_image(client, image)
        path = os.path.join(codedir, os.path.basename(CODE_FILE))
        with open(path, "w", encoding="utf-8") as f:
            f.write(code)
        os.chmod(path, 0o644)
        os.chmod(codedir, 0o755)
        nobody, size = pwd.getpwnam("nobody"), f"{disk_mb}m"
        # An image's declared VOLUMEs would become anonymous volumes on the host's disk, outside every size limit and
        # left behind: each gets a private tmpfs instead (a tmpfs mount replaces the volume).
        declared = (client.images.get(image).attrs.get("Config") or {}).get("Volumes") or {}
        volumes_tmpfs = {v: f"size={size},mode=1777" for v in declared if v not in _OWN_MOUNTS}
        # create + start, never containers.run: run pulls a missing image from a registry by itself. The entrypoint
        # is set (the command's program), so an image's ENTRYPOINT never wraps or replaces the sandbox's command.
        container = client.containers.create(
            image,
            command[1:],
            entrypoint=command[:1],
            network_mode="none",
            mem_limit=f"{memory_mb}m",
            memswap_limit=f"{memory_mb}m",
            pids_limit=max_procs,
            nano_cpus=int(CONTAINER_CPUS * 1e9),
            read_only=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            user=f"{nobody.pw_uid}:{nobody.pw_gid}",
            working_dir="/scratch",
            tmpfs={
                **volumes_tmpfs,
                "/scratch": f"size={size},mode=0700,uid={nobody.pw_uid},gid={nobody.pw_gid}",
                "/tmp": f"size={size},mode=1777",
            },
            shm_size=disk_mb << 20,
            volumes={codedir: {"bind": os.path.dirname(CODE_FILE), "mode": "ro"}},
            environment=environment,
            log_config=docker.types.LogConfig(type=docker.types.LogConfig.types.NONE),
        )
        # Attached before it starts: nothing it writes is missed, the READY mark included.
        stream = container.attach(stdout=True, stderr=True, stream=True, demux=True)
        try:
            container.start()
            return _collect(container, stream, timeout_s, *output_limits(max_output_chars))
        finally:
            stream.close()
    finally:
        if container is not None:
            with contextlib.suppress(Exception):
                container.remove(force=True, v=True)  # v: any volume it has goes with it
        client.close()
        shutil.rmtree(codedir, ignore_errors=True)


def _collect(
    container: Any, stream: Any, timeout_s: float, keep: int, flood: int
) -> tuple[bytes, bytes, int | None, str]:
    """Read the container's output while waiting for it: its streams (``keep`` bytes of each), exit code and status;
    killed at the deadline, at the calling thread's cancel event (watched every 0.1 s as the other backends do) or
    after ``flood`` bytes of output."""
    out, err = bytearray(), bytearray()
    box: dict[str, Any] = {"total": 0}  # total bytes read; then the exit "code" or the engine's "error"
    exited, eof, flooded = threading.Event(), threading.Event(), threading.Event()

    def wait() -> None:
        try:
            box["code"] = container.wait()["StatusCode"]
        except Exception as exc:  # the engine went away: the sandbox failed
            box["error"] = exc
        finally:
            exited.set()

    def read() -> None:
        try:
            for chunks in stream:
                for buf, chunk in zip((out, err), chunks, strict=True):
                    if chunk:
                        box["total"] += len(chunk)
                        buf.extend(chunk[: max(0, keep - len(buf))])
                if box["total"] > flood:
                    flooded.set()  # and read on, dropping it: a writer blocked on a full pipe delays its own kill
        except Exception:  # the stream closed under the reader: the call is over
            pass
        finally:
            eof.set()

    for target in (wait, read):
        threading.Thread(target=target, name=f"arpo-docker-{target.__name__}", daemon=True).start()
    deadline, cancel, status = time.monotonic() + timeout_s, cancel_event(), "ok"
    while not exited.wait(0.1):
        if cancel is not None and cancel.is_set():
            status = "cancelled"
        elif flooded.is_set():
            status = "flood"
        elif time.monotonic() > deadline:
            status = "timeout"
        if status != "ok":
            break
    if status != "ok":
        with contextlib.suppress(Exception):  # it may have exited meanwhile
            container.kill()
        exited.wait(30)
        return bytes(out), bytes(err), None, status
    if "error" in box:
        raise SandboxError(f"the Docker engine failed while waiting for the container: {box['error']}")
    eof.wait(1.0)  # the rest of its output, already written
    return bytes(out), bytes(err), box["code"], "flood" if flooded.is_set() else status


def image_status(image: str = DEFAULT_IMAGE) -> dict:
    """For ``arpo doctor``: ``{"image", "present": bool | None, "detail"}`` (None: no engine or client to ask)."""
    try:
        client = docker_client()
    except SandboxError as exc:
        return {"image": image, "present": None, "detail": exc.message}
    try:
        present = image_present(client, image)
    finally:
        client.close()
    return {
        "image": image,
        "present": present,
        "detail": "in the local engine" if present else f"missing: {BUILD_COMMAND}",
    }


def docker_backend_problem(image: str = DEFAULT_IMAGE) -> str | None:
    """Why ``PythonTool(backend="docker", docker_image=image)`` cannot run here (the package, the engine, the image,
    with what to do), or None when all three are present."""
    try:
        client = docker_client()
    except SandboxError as exc:
        return f"{exc.message} ({exc.hint})"
    try:
        if not image_present(client, image):
            return f"the Docker sandbox image {image} is not in the local engine ({BUILD_COMMAND})"
    finally:
        client.close()
    return None


def _os_codename(os_release: str) -> str | None:
    try:
        with open(os_release, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.strip().partition("=")
                if key == "VERSION_CODENAME" and value.strip('"'):
                    return value.strip('"')
    except OSError:
        pass
    return None


def _source_entries(apt_dir: str) -> list[dict]:
    """The ``deb`` entries of apt's source lists, in apt's order: one-line ``.list`` files and deb822 ``.sources``."""
    entries: list[dict] = []
    files = [
        os.path.join(apt_dir, "sources.list"),
        *sorted(glob.glob(os.path.join(apt_dir, "sources.list.d", "*.list"))),
        *sorted(glob.glob(os.path.join(apt_dir, "sources.list.d", "*.sources"))),
    ]
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        if path.endswith(".sources"):
            for stanza in text.split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line or line[:1].isspace():
                        continue
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
                if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
                    for uri in fields.get("uris", "").split():
                        entries.append(
                            {
                                "uri": uri,
                                "suites": fields.get("suites", "").split(),
                                "components": fields.get("components", "").split(),
                            }
                        )
        else:
            for line in text.splitlines():
                words = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()  # options: [arch=amd64 ...]
                if len(words) >= 3 and words[0] == "deb":
                    entries.append({"uri": words[1], "suites": [words[2]], "components": words[3:]})
    return entries


def debian_source(apt_dir: str = "/etc/apt", os_release: str = "/etc/os-release") -> tuple[str, str]:
    """``(mirror, suite)``: the first apt source of this machine's own release with the ``main`` component.

    ConfigError when the machine names none (not Debian, no such source): the hint says how to name one."""
    suite = _os_codename(os_release)
    if suite is None:
        raise ConfigError(
            f"cannot tell this machine's Debian release: {os_release} has no VERSION_CODENAME",
            hint="name them: --suite bookworm --mirror http://deb.debian.org/debian",
        )
    for entry in _source_entries(apt_dir):
        if suite in entry["suites"] and "main" in entry["components"] and entry["uri"].startswith(("http", "file:")):
            return entry["uri"], suite
    raise ConfigError(
        f"no apt source of {apt_dir} serves '{suite} main' (the release this machine runs)",
        hint="name a Debian mirror: --mirror URL (and --suite NAME)",
    )


def build_image(
    tag: str = DEFAULT_IMAGE,
    mirror: str | None = None,
    suite: str | None = None,
    rebuild: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Build ``tag`` from Debian packages and import it into the local engine; reuse it when present (unless
    ``rebuild``). Returns ``{"image", "built", "seconds", "size_mb", "mirror", "suite"}``.

    Needs root (debootstrap), ``debootstrap`` and a Docker engine; each missing piece is a SandboxError naming it."""
    client = docker_client()
    try:
        if not rebuild and image_present(client, tag):
            log(f"{tag} is already in the local engine (--rebuild builds it again)")
            return {"image": tag, "built": False, **_size(client, tag)}
        if os.geteuid() != 0:
            raise SandboxError(
                "building the sandbox image needs root (debootstrap creates device nodes and file owners)",
                hint=f"run `sudo {BUILD_COMMAND}`",
            )
        if shutil.which("debootstrap") is None:
            raise SandboxError("debootstrap is not installed", hint="apt-get install debootstrap")
        if mirror is None or suite is None:
            found_mirror, found_suite = debian_source()
            mirror, suite = mirror or found_mirror, suite or found_suite
        start = time.monotonic()
        work = tempfile.mkdtemp(prefix="arpo-sandbox-image-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
        try:
            root = os.path.join(work, "root")
            log(f"debootstrap {suite} from {mirror} (packages: {', '.join(PACKAGES)}) ...")
            cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", suite, root, mirror]
            with open(os.path.join(work, "debootstrap.log"), "w+") as out:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
                if rc != 0:
                    out.seek(0)
                    tail = "".join(out.readlines()[-15:]).strip()
                    raise SandboxError(
                        f"debootstrap failed (exit {rc}):\n{tail}",
                        hint="check the mirror (--mirror URL) and the network to it",
                    )
            _finish_root(root)
            log(f"importing into the local engine as {tag} ...")
            _import(client, root, tag, mirror, suite)
        finally:
            _unmount_below(work)  # a debootstrap that failed half-way leaves /proc mounted in the new root
            shutil.rmtree(work, ignore_errors=True)
        seconds = time.monotonic() - start
        info = {
            "image": tag,
            "built": True,
            "seconds": round(seconds, 1),
            **_size(client, tag),
            "mirror": mirror,
            "suite": suite,
        }
        log(f"built {tag} in {seconds:.0f} s ({info['size_mb']} MB)")
        return info
    finally:
        client.close()


def _unmount_below(folder: str) -> None:
    with open("/proc/self/mounts", encoding="utf-8") as f:
        points = [line.split()[1].replace("\\040", " ") for line in f]
    for point in sorted((p for p in points if p.startswith(folder.rstrip("/") + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def _size(client, tag: str) -> dict:
    return {"size_mb": round(client.images.get(tag).attrs.get("Size", 0) / 1e6, 1)}


def _finish_root(root: str) -> None:
    """Drop the package caches and add the non-root user (written into the files: nothing of the image runs here)."""
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin"):
        for path in glob.glob(os.path.join(root, pattern)):
            os.unlink(path)
    shutil.rmtree(os.path.join(root, "var/lib/apt/lists"), ignore_errors=True)
    os.makedirs(os.path.join(root, "var/lib/apt/lists/partial"), exist_ok=True)
    for name, line in (
        ("passwd", f"{USER}:x:{USER_ID}:{USER_ID}::/home/{USER}:/bin/sh\n"),
        ("group", f"{USER}:x:{USER_ID}:\n"),
        ("shadow", f"{USER}:!:19000::::::\n"),
    ):
        with open(os.path.join(root, "etc", name), "a", encoding="utf-8") as f:
            f.write(line)
    home = os.path.join(root, "home", USER)
    os.makedirs(home, mode=0o755, exist_ok=True)
    os.chown(home, USER_ID, USER_ID)


def _import(client, root: str, tag: str, mirror: str, suite: str) -> None:
    repository, _, version = tag.rpartition(":") if ":" in tag.split("/")[-1] else (tag, "", "latest")
    changes = [
        f"ENV PATH={PATH}",
        f'LABEL org.arpo.sandbox.recipe="{RECIPE}" org.arpo.sandbox.suite="{suite}" org.arpo.sandbox.mirror="{mirror}"',
    ]
    tar = subprocess.Popen(["tar", "-C", root, "--numeric-owner", "-cf", "-", "."], stdout=subprocess.PIPE)
    try:
        client.api.import_image_from_stream(tar.stdout, repository=repository, tag=version, changes=changes)
    finally:
        with contextlib.suppress(OSError):
            if tar.stdout is not None:  # a pipe (stdout=PIPE above)
                tar.stdout.close()
        if tar.wait() != 0:
            raise SandboxError(f"tar of the image root failed (exit {tar.returncode})")
    if not image_present(client, tag):
        raise SandboxError(f"the engine did not keep the imported image {tag}", hint="see the engine's log")
