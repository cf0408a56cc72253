"""Administration of a running ``arpo serve``: who may change the agents, from where, how much, and how a change is
applied all or nothing (docs/security.md, "Live agent changes"; docs/howto/serving.md, "Changing the agents live").

Invariants:

- Only the administration key changes or lists the agents (:data:`serve.guard.ADMIN_PATHS`); it is never the chat
  key, and a server started without one refuses every change (403).
- A source is read only when its real path lies under a root the operator named (:class:`AdminPolicy`); a source
  outside reads the same refusal whether or not it exists. Inside, only folders and regular files are accepted, a
  JSON file is opened non-blocking and measured on its descriptor before anything reads it, and the counts and sizes
  are bounded. The weights of the set after a change must fit the operator's memory budget.
- A change is loaded in every replica beside the served agents (``stage`` in the deployment's ``user_config``: see
  :func:`reconfigure`) before any of them is touched, and each replica reports how it went; only when every replica
  loaded it is it committed (a swap of routing that loads nothing), otherwise every replica drops what it loaded and
  serves what it served. A change runs alone (429 beyond one) on the replicas' admin thread, never a chat thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from arpo_base.errors import ConfigError

#: Agents one change may add, and agents a server may hold after a change (``--admin-max-*``).
MAX_AGENTS_PER_CHANGE, MAX_AGENTS = 8, 32
#: The largest JSON file a change lets arpo read (config, markers, records); a tokenizer's vocabulary files (which the
#: engine reads, and which are megabytes for real models) have their own bound.
MAX_JSON_BYTES, MAX_VOCAB_BYTES = 1024 * 1024, 64 * 1024 * 1024
VOCAB_FILES = frozenset({"tokenizer.json", "vocab.json"})
#: How many entries a source folder may hold (all its subfolders together), and how deep it is walked.
MAX_ENTRIES, MAX_DEPTH = 4096, 6
#: How long a change may take (``--admin-timeout``): past it, a change still loading is dropped everywhere (504).
CHANGE_TIMEOUT_S = 600.0
#: How much longer than that a replica waits for the owner's answer before it answers 504 by itself.
ANSWER_SLACK_S = 30.0
NARROW_HINT = "name the policy folder itself (a checkpoint's policy/ or an exported model), not a whole run folder"
#: Files whose size counts as weights (the memory budget).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
log = logging.getLogger("arpo.serve")


@dataclass
class AdminPolicy:
    """What a live change may do, checked by the deployment's owner before anything resolves or loads.

    Attributes:
        roots: Folders sources must lie under (their real paths; ``--admin-root``).
        max_per_change: Agents one change may add.
        max_agents: Agents served after a change.
        memory_budget_bytes: The weights of every agent served after a change, a shared base counted once; None:
            no budget.
        timeout_s: A change's deadline.
    """

    roots: list[str]
    max_per_change: int = MAX_AGENTS_PER_CHANGE
    max_agents: int = MAX_AGENTS
    memory_budget_bytes: int | None = None
    timeout_s: float = CHANGE_TIMEOUT_S
    _bases: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if not self.roots:
            raise ConfigError("live changes need at least one --admin-root", hint="the folder agents may come from")
        real = [os.path.realpath(r) for r in self.roots]
        for given, r in zip(self.roots, real, strict=True):
            if not os.path.isdir(r):
                raise ConfigError(f"--admin-root {given}: not a folder")
            if r == os.sep:
                raise ConfigError("--admin-root /: the whole file system is not a root", hint="name a folder")
        self.roots = real
        for key in ("max_per_change", "max_agents"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.timeout_s <= 0 or (self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0):
            raise ConfigError("the admin timeout and memory budget must be > 0")

    def under(self, real: str) -> bool:
        return any(real == r or real.startswith(r + os.sep) for r in self.roots)

    def source(self, text: str) -> str:
        """``[NAME=]PATH`` -> ``[NAME=]REALPATH`` of a folder under a root, its tree checked (:meth:`scan`).
        Relative paths are taken under the first root. Every source outside the roots (missing or not, a link
        leading out, ``~user``) reads the same refusal."""
        name, _, path_text = text.rpartition("=") if "=" in text else ("", "", text)
        shown = name or path_text
        refused = ConfigError(
            f"agent {shown!r}: the source is not a model folder under the admin roots",
            hint="sources of a live change are folders under the server's --admin-root",
        )
        if not path_text or "\0" in path_text:
            raise refused
        real = os.path.realpath(os.path.join(self.roots[0], path_text))  # an absolute path_text stays itself
        if not self.under(real):
            raise refused
        try:
            if not stat.S_ISDIR(os.stat(real).st_mode):
                raise refused
        except OSError:
            raise refused from None
        self._bases = set()
        try:
            self.scan(real, shown)
        except OSError as e:
            raise ConfigError(f"agent {shown!r}: a file of the source cannot be read ({e.strerror})") from None
        return f"{name}={real}" if name else real

    def scan(self, folder: str, shown: str) -> None:
        """Every entry under ``folder``: a folder or a regular file whose real path stays under the roots, at most
        :data:`MAX_ENTRIES` of them; each JSON file within its size bound (:meth:`check_json`)."""
        count, stack = 0, [(folder, 0)]
        while stack:
            here, depth = stack.pop()
            with os.scandir(here) as it:
                entries = sorted(e.name for e in it)
            for entry in entries:
                count += 1
                rel = os.path.relpath(os.path.join(here, entry), folder)
                if count > MAX_ENTRIES:
                    raise ConfigError(
                        f"agent {shown!r}: the source holds more than {MAX_ENTRIES} entries", hint=NARROW_HINT
                    )
                real = os.path.realpath(os.path.join(here, entry))
                if not self.under(real):
                    raise ConfigError(f"agent {shown!r}: {rel} leads outside the admin roots")
                mode = os.stat(real).st_mode
                if stat.S_ISDIR(mode):
                    if depth < MAX_DEPTH:
                        stack.append((real, depth + 1))
                elif not stat.S_ISREG(mode):
                    raise ConfigError(f"agent {shown!r}: {rel} is not a regular file or a folder")
                elif entry.endswith(".json"):
                    self.check_json(real, shown, rel)

    def check_json(self, path: str, shown: str, rel: str) -> None:
        """Open without blocking (a FIFO swapped in is never waited on) and without following a link, measure on
        the descriptor; an adapter's record names its base, which must lie under the roots too (and is scanned)."""
        from arpo_algo.models.lora import ADAPTER_MARKER

        limit = MAX_VOCAB_BYTES if os.path.basename(path) in VOCAB_FILES else MAX_JSON_BYTES
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(f"agent {shown!r}: {rel} is not a regular file")
            if info.st_size > limit:
                raise ConfigError(f"agent {shown!r}: {rel} is larger than {limit} bytes", hint=NARROW_HINT)
            if os.path.basename(path) != ADAPTER_MARKER:
                return
            with os.fdopen(os.dup(fd), "rb") as f:
                text = f.read(limit + 1)
        finally:
            os.close(fd)
        try:
            base = json.loads(text).get("base")
        except (ValueError, AttributeError):
            return  # resolving the folder refuses it, naming the file
        real = os.path.realpath(str(base)) if isinstance(base, str) and base and "\0" not in base else ""
        if not real or not self.under(real) or not os.path.isdir(real):
            raise ConfigError(f"agent {shown!r}: its base model is not a folder under the admin roots")
        if real not in self._bases:
            self._bases.add(real)
            self.scan(real, shown)

    def check_budget(self, specs: list[Any]) -> None:
        """Refuse a set whose weights exceed the memory budget (a base its adapters share counted once)."""
        if self.memory_budget_bytes is None:
            return
        total = served_weights(specs)
        if total > self.memory_budget_bytes:
            gib = 1024**3
            raise ConfigError(
                f"the agents after this change hold {total / gib:.2f} GiB of weights, over the server's memory "
                f"budget of {self.memory_budget_bytes / gib:.2f} GiB",
                hint="remove agents in the same change, or start arpo serve with a larger --admin-memory-budget",
            )


def weights_bytes(folder: str) -> int:
    """The size of the weight files directly in a model folder (stat only)."""
    try:
        with os.scandir(folder) as it:
            return sum(e.stat().st_size for e in it if e.is_file() and e.name.endswith(WEIGHT_SUFFIXES))
    except OSError:
        return 0


def served_weights(specs: list[Any]) -> int:
    """The weights a replica holds for ``specs``: each agent's own, and the base of adapters once."""
    held: dict[str, int] = {}
    for s in specs:
        if s.base:
            held.setdefault(f"base:{s.fingerprint}", weights_bytes(s.base))
            held[f"adapter:{s.name}"] = weights_bytes(s.model_path)
        else:
            held.setdefault(f"base:{s.fingerprint}" if s.fingerprint else s.model_path, weights_bytes(s.model_path))
    return sum(held.values())


# ----------------------------------------------------------------------------------------------- replica side
def admin_pool() -> ThreadPoolExecutor:
    """A replica's admin threads, never a chat thread: one for a change's loads (Serve reconfigures a replica one
    configuration at a time), one for finding the owner's mailbox meanwhile (so a 429 never waits for a load)."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="arpo-serve-admin")


def _answer(status: int, message: str, code: str) -> Any:
    from fastapi.responses import JSONResponse

    from serve.schema import APIError

    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse(APIError(message, status=status, type=kind, code=code).body(), status_code=status)


async def _owner(server: Any) -> Any:
    """The owner's mailbox (found once, then kept), or None for a deployment arpo serve did not start."""
    if getattr(server, "mailbox", None) is None:
        server.mailbox = await asyncio.get_running_loop().run_in_executor(server.admin_pool, _mailbox)
    return server.mailbox


def _mailbox() -> Any:
    import ray

    from serve.live import MAILBOX, NAMESPACE

    try:
        return ray.get_actor(MAILBOX, namespace=NAMESPACE)
    except ValueError:
        return None


async def change(server: Any, request: Any) -> Any:
    """``POST /v1/agents``: hand the change to the deployment's owner and answer what it says. The guard let only
    the administration key through; checked here again (the guard's checks can be off for a benchmark)."""
    from fastapi.responses import JSONResponse

    from serve.agent_set import load_failure
    from serve.guard import BODY_TIMEOUT_S
    from serve.live import POLL_S, parse_change

    if not server.policy.admin_authorized(dict(request.headers)):
        return _answer(403, "live agent changes need the admin key", "forbidden")
    try:
        raw = await asyncio.wait_for(request.body(), BODY_TIMEOUT_S)
        body = parse_change(json.loads(raw or b"null"))
    except ConfigError as e:
        return _answer(400, load_failure(e), "invalid_change")
    except ValueError as e:
        return _answer(400, f"the body is not JSON: {e}", "invalid_change")
    box = await _owner(server)
    if box is None:
        return _answer(
            409, "this deployment was not started by arpo serve, so nothing here can redeploy it", "no_owner"
        )
    ticket = await box.submit.remote(body)
    if ticket is None:
        return _answer(429, "another change of the agents is in progress; retry when it is done", "change_in_progress")
    number, timeout_s = ticket
    deadline = time.monotonic() + timeout_s + ANSWER_SLACK_S
    while time.monotonic() < deadline:
        answer = await box.result.remote(number)
        if answer is not None:
            if "error" in answer:
                hint = f" (hint: {answer['hint']})" if answer.get("hint") else ""
                return _answer(answer.get("status", 400), answer["error"] + hint, answer.get("code", "invalid_change"))
            return JSONResponse({"change": number, "models": answer["models"]})
        await asyncio.sleep(POLL_S)
    return _answer(504, "the change got no answer in time: GET /v1/agents says whether it was applied", "timeout")


async def status(server: Any, request: Any) -> Any:
    """``GET /v1/agents``: the agents served and the last change's outcome (``applied``, ``refused``,
    ``not applied`` after its deadline, ``in progress``), as the owner recorded it."""
    from fastapi.responses import JSONResponse

    if not server.policy.admin_authorized(dict(request.headers)):
        return _answer(403, "listing the agents' changes needs the admin key", "forbidden")
    box = await _owner(server)
    if box is None:
        return _answer(409, "this deployment was not started by arpo serve", "no_owner")
    return JSONResponse(await box.status.remote())


def reconfigure(server: Any, config: dict[str, Any]) -> None:
    """Serve's live update of one replica (on its admin thread). ``config``:

    - ``{"agents": served, "stage": {"id": N, "agents": new}}``: load ``new`` beside the served agents and report to
      the owner's mailbox whether it loaded (never raises: nothing served changes either way);
    - ``{"agents": new, "commit": N}``: serve the set staged for change N (routing only);
    - ``{"agents": specs}``: drop anything staged and serve ``specs``, loading what is missing (a replica's first
      configuration, ``serve deploy``, an owner's roll-back to the served set, which loads nothing).
    """
    from serve.agent_set import agents_from_config, load_failure

    server.loaded.wait()
    if server.load_error:
        raise RuntimeError(server.load_error)
    config = dict(config or {})
    stage, commit = config.pop("stage", None), config.pop("commit", None)
    target = agents_from_config(config)
    held, server.staged = server.staged, None
    if stage is not None:
        if held is not None:
            server.set.discard(held[1])
        if server.set.specs != target:  # a replica started during the change serves the served set first
            server.set.apply(target)
        error = None
        try:
            if server.refuse_next_change_with:  # the all-or-nothing test's one-replica fault
                reason, server.refuse_next_change_with = server.refuse_next_change_with, None
                raise ConfigError(reason)
            server.staged = (stage["id"], server.set.prepare(agents_from_config({"agents": stage["agents"]})))
        except Exception as e:  # noqa: BLE001 - reported to the owner; the replica serves on
            log.error("staging change %s failed", stage["id"], exc_info=e)
            error = str(e) if not isinstance(e, ConfigError) else load_failure(e)
        _report(stage["id"], error)
        return
    if held is not None and commit == held[0] and held[1].specs == target:
        server.set.commit(held[1])
        return
    if held is not None:
        server.set.discard(held[1])
    server.set.apply(target)


def _report(number: int, error: str | None) -> None:
    import ray

    box = _mailbox()
    if box is not None:
        ray.get(box.report.remote(number, ray.get_runtime_context().get_actor_id(), error))
