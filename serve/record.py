"""Episode recording (``arpo serve --record DIR``) and rewards posted by API, for training the agent a harness runs.

Layout: ``DIR/<scope>/<episode>.jsonl`` holds one JSON line per served request of that episode (a *turn*), appended
and fsynced before the answer goes out; ``DIR/<scope>/<episode>.reward.json`` holds its reward, written once.
``<scope>`` is a hash of the client's credential (never the credential): two clients with different keys name their
episodes independently and cannot write into each other's. ``DIR/record.json`` holds the settings a reader needs (the
reward deadline).

Invariants:

- Token faithfulness: a turn's ``prompt_ids`` are what the engine was given. When a request's messages are the
  previous turn's messages plus one of its replies (the same text) and new messages, the prompt is the previous
  prompt, that reply's recorded ids and the new messages' ids: never the reply re-tokenised. Such a turn continues
  the segment; any other (a rewritten history) starts a new one, and the turn says why.
- Every recorded turn is kept; a turn the learner cannot score (a reply cut by the length limit, greedy or ``top_p``
  sampling, log-probs the engine cannot give) says why, per choice, and is counted.
- Recording never fails a request: a full folder or a failed write leaves the turn unrecorded, logged and counted.
- A reader skips a torn last line (a server killed mid-write); the next append cuts it away first.
- A reward closes its episode: it records how many turns it was given for, and the trainer reads no more than those
  (a request in flight when the reward was posted may still append a turn).

The readers (the folder check, the line reader, the survey of a folder) live with the trainer's reader of the
episodes, :mod:`arpo_algo.rollout.records`, which ``arpo train`` uses as well (``training.records``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo_algo.rollout.records import (  # noqa: F401 - the readers the folder's users import from here too
    DEFAULT_REWARD_DEADLINE_S,
    FORMAT,
    SETTINGS,
    private_folder,
    read_episodes,
    read_lines,
)
from arpo_base.errors import ConfigError
from arpo_base.paths import fsync_dir
from serve.errors import APIError
from serve.record_turns import continuation_ids, same_reply, turn_record

log = logging.getLogger("arpo.serve.record")

#: An episode id: letters, digits, ``.``, ``_``, ``-`` (not first), at most 128 characters.
EPISODE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
#: The header that names an episode when the request body cannot (``x-request-*`` headers are the proxy's own).
EPISODE_HEADER = "arpo-episode"
DEFAULT_MAX_BYTES = 10 * 1024**3


def check_episode_id(value: Any, where: str = "arpo.episode") -> str:
    """An episode id as the client sent it, or a 400 naming the rule."""
    if not isinstance(value, str) or not EPISODE_RE.fullmatch(value):
        raise APIError(
            f"'{where}' must be 1 to 128 characters among letters, digits, '.', '_' and '-' (not starting with "
            f"'.' or '-'), got {json.dumps(value)[:80]}",
            param=where,
        )
    return value


def request_episode(req: Any, headers: dict[str, str], recorder: Any) -> str:
    """Settle a chat request's episode (its ``arpo.episode`` or the ``arpo-episode`` header, which must agree) and
    return its scope, the hash of the credential it carries. An episode on a server that records none is a 400."""
    header = headers.get(EPISODE_HEADER)
    if header is not None:
        header = check_episode_id(header, f"the {EPISODE_HEADER} header")
        if req.episode is not None and req.episode != header:
            raise APIError(f"'arpo.episode' and the {EPISODE_HEADER} header name different episodes", param="arpo")
        req.episode = header
    if req.task is not None and req.episode is None:
        raise APIError("'arpo.task' names the task of an episode: name the episode too", param="arpo.task")
    if req.episode is not None and recorder is None:
        raise APIError(
            "this server records no episodes (it was started without --record DIR); leave the episode out",
            param="arpo.episode",
        )
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scope_of(token.strip() if scheme.lower() == "bearer" else None)


def check_record(security: Any, record: RecordConfig | None) -> None:
    """Refuse (before anything is deployed) a rewards key equal to the chat or admin key, a rewards key without a
    record folder (its route would reward nothing), and a record folder that is not private."""
    security.rewards_key()
    if record is not None:
        record.check()
        private_folder(record.dir)
    elif security.rewards_key_file:
        raise ConfigError("a rewards key needs a record folder (arpo serve --record DIR): there is nothing to reward")


async def post_reward(recorder: Recorder | None, request: Any, pool: Any) -> tuple[int, dict[str, Any]]:
    """``POST /v1/rewards`` (the guard has checked the rewards key): (status, body), OpenAI-shaped on an error."""
    import asyncio

    from serve.guard import BODY_TIMEOUT_S

    try:
        if recorder is None:
            raise APIError("this server records no episodes (arpo serve --record DIR)", status=404, code="not_found")
        body = json.loads(await asyncio.wait_for(request.body(), BODY_TIMEOUT_S))
        return 200, await asyncio.get_running_loop().run_in_executor(pool, recorder.post_reward, body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        err = APIError(f"the request body is not valid JSON: {e}")
    except TimeoutError:
        err = APIError(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", status=408, code="timeout")
    except APIError as e:
        err = e
    return err.status, err.body()


def scope_of(credential: str | None) -> str:
    """The folder of a credential's episodes: a hash of the key (``anonymous`` on a server without one)."""
    if not credential:
        return "anonymous"
    return hashlib.sha256(b"arpo-episode-scope\0" + credential.encode()).hexdigest()[:24]


def _digest(messages: list[dict[str, Any]]) -> str:
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class RecordConfig:
    """What ``arpo serve --record`` sets (plain data: it travels to the replicas)."""

    dir: str
    max_bytes: int = DEFAULT_MAX_BYTES
    reward_deadline_s: float = DEFAULT_REWARD_DEADLINE_S

    def check(self) -> None:
        if self.max_bytes <= 0:
            raise ConfigError(f"the record folder's size cap must be > 0 bytes, got {self.max_bytes}")
        if not math.isfinite(self.reward_deadline_s) or self.reward_deadline_s <= 0:
            raise ConfigError(f"--reward-deadline must be > 0 seconds, got {self.reward_deadline_s:g}")


@dataclass
class Turn:
    """One request of an episode being served: where it goes and how its prompt was rendered."""

    recorder: Recorder
    path: Path
    episode: str
    index: int
    segment: int
    continues: bool
    segment_reason: str
    messages: list[dict[str, Any]]
    logprob_problem: str | None = None
    after: int | None = None  # the episode's last recorded turn when this one began (None: the first)
    task: str | None = None  # the client's task id: the episodes of one task are a training group
    started: float = field(default_factory=time.time)
    refused: str | None = None  # why this turn is not recorded (the request is still served)
    unscoreable: int = 0  # choices the learner cannot score

    def public(self) -> dict[str, Any]:
        """What a reply says about its turn (``message.arpo.record``)."""
        if self.refused:
            return {"recorded": False, "reason": self.refused}
        return {
            "recorded": True,
            "episode": f"{self.path.parent.name}/{self.episode}",
            "turn": self.index,
            "segment": self.segment,
            "continues": self.continues,
            "unscoreable": self.unscoreable,
        }


class Recorder:
    """A replica's recorder: appends turns, renders a continued history from recorded ids, stores rewards.

    Each episode's last turn is cached (keyed by its file's size), so a long episode is not re-read per request; a
    new process reads it from the file, so a restarted server continues the episode where it stopped."""

    def __init__(self, config: RecordConfig) -> None:
        config.check()
        self.config = config
        self.root = private_folder(config.dir)
        self._lock = threading.Lock()
        self._last: dict[Path, tuple[int, dict[str, Any]]] = {}
        self.counts = {"turns": 0, "unscoreable": 0, "continued": 0, "new_segments": 0, "refused": 0, "rewards": 0}
        self.bytes = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
        settings = {"format": FORMAT, "reward_deadline_s": config.reward_deadline_s}
        self._write_new(self.root / SETTINGS, settings, replace=True)

    # ------------------------------------------------------------------------------------------------- turns
    def episode_path(self, scope: str, episode: str) -> Path:
        return self.root / scope / f"{episode}.jsonl"

    def _last_turn(self, path: Path) -> dict[str, Any] | None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        with self._lock:
            hit = self._last.get(path)
        if hit and hit[0] == size:
            return hit[1]
        turns = read_lines(path)
        last = turns[-1] if turns else None
        if last is not None:
            with self._lock:
                self._last[path] = (size, last)
        return last

    def begin(self, scope: str, episode: str, messages: list[dict[str, Any]]) -> tuple[Turn, dict | None]:
        """The turn a request of ``episode`` will be, and the recorded turn whose reply its history continues (None:
        a new segment). The prompt is rendered by :meth:`render`."""
        path = self.episode_path(scope, episode)
        last = self._last_turn(path)
        turn = Turn(self, path, episode, 0, 0, False, "first turn", messages)
        if last is not None:
            turn.index, turn.segment, turn.after = last["turn"] + 1, last["segment"], last["turn"]
        if self.bytes >= self.config.max_bytes:
            turn.refused = "the record folder is full"
        elif path.with_suffix(".reward.json").exists():
            turn.refused = "the episode is already rewarded"
        if turn.refused:
            self._refuse(turn)
            return turn, None
        if last is None:
            return turn, None
        n = last["n_messages"]
        prev = None
        if len(messages) > n + 1 and _digest(messages[:n]) == last["messages_digest"]:
            reply = messages[n]
            if reply["role"] == "assistant":
                prev = next((c for c in last["choices"] if same_reply(c, reply)), None)
        if prev is None:
            turn.segment, turn.segment_reason = last["segment"] + 1, "history rewritten"
            return turn, None
        turn.continues, turn.segment_reason = True, "continues"
        return turn, {"prompt_ids": last["prompt_ids"], "choice": prev, "n_messages": n}

    def render(self, agent: Any, req: Any, scope: str, ids: list[int]) -> tuple[Turn, list[int]]:
        """The turn of a request of an episode and its prompt ids: ``ids`` (the messages rendered afresh) unless the
        history continues a recorded reply, then the recorded ids extended (:func:`continuation_ids`)."""
        turn, prev = self.begin(scope, req.episode, req.messages)
        turn.task = req.task
        if prev is None:
            return turn, ids
        faithful = continuation_ids(agent.tok, agent.session, prev, req.messages)
        if faithful is None:
            turn.continues, turn.segment = False, turn.segment + 1
            turn.segment_reason = "history rewritten (tool results mixed with other messages after the reply)"
            return turn, ids
        return turn, faithful

    def finish(self, spec: Any, job: Any, traces: list[Any], choices: list[dict[str, Any]], values: Any) -> None:
        """Record a served turn and tell each choice where it went (``message.arpo.record``). Never raises: a fault
        here is logged and counted, and the request is answered."""
        turn = job.turn
        try:
            if not turn.refused:
                self.append(turn, turn_record(spec, job, traces, choices, values))
        except Exception as e:  # noqa: BLE001 - recording must not fail serving
            log.error("recording a turn of episode %s failed", turn.episode, exc_info=e)
            turn.refused = f"recording failed ({type(e).__name__})"
            with self._lock:
                self.counts["refused"] += 1
        for choice in choices:
            choice["message"]["arpo"]["record"] = turn.public()

    def _refuse(self, turn: Turn) -> None:
        with self._lock:
            self.counts["refused"] += 1
        log.warning("not recording a turn of episode %s: %s", turn.episode, turn.refused)

    def append(self, turn: Turn, record: dict[str, Any]) -> None:
        """Append one turn (fsynced). A failure is logged and counted; the request is answered anyway."""
        choices = record["choices"]
        try:
            fresh = not turn.path.parent.exists()
            turn.path.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(turn.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as e:
            turn.refused = f"writing the record failed: {e.strerror}"
            self._refuse(turn)
            return
        try:
            # One writer at a time per episode, across threads and replicas: a turn served while another of its
            # episode was being answered is placed after it, never beside it with the same index.
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._place_after_concurrent(turn, fd)
            line = self._line(turn, record)
            data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last line (never answered): cut away
                os.ftruncate(fd, os.pread(fd, size, 0).rfind(b"\n") + 1)
            os.write(fd, data)
            os.fsync(fd)
            size = os.fstat(fd).st_size
            if fresh or turn.index == 0:
                fsync_dir(turn.path.parent)
        except OSError as e:
            turn.refused = f"writing the record failed: {e.strerror}"
            self._refuse(turn)
            return
        finally:
            os.close(fd)  # closing releases the lock
        with self._lock:
            self.bytes += len(data)
            self._last[turn.path] = (size, line)
            self.counts["turns"] += 1
            self.counts["continued" if turn.continues else "new_segments"] += 1
            turn.unscoreable = sum(bool(c["unscoreable"]) for c in choices)
            self.counts["unscoreable"] += bool(turn.unscoreable)

    def _place_after_concurrent(self, turn: Turn, fd: int) -> None:
        """When turns of the episode were recorded after this one began (requests of one episode served side by
        side), this turn follows the last of them, in a segment of its own: its prompt stays exactly what the engine
        was given, and no segment gets two continuations of one reply."""
        size = os.fstat(fd).st_size
        if not size:
            return
        with self._lock:
            hit = self._last.get(turn.path)
        last = hit[1] if hit and hit[0] == size else (read_lines(turn.path) or [None])[-1]
        if last is None or last["turn"] == turn.after:
            return
        turn.index, turn.segment, turn.continues = last["turn"] + 1, last["segment"] + 1, False
        turn.segment_reason = f"served while turn {last['turn']} of the episode was recorded"

    def _line(self, turn: Turn, record: dict[str, Any]) -> dict[str, Any]:
        """A turn's record line: its place in the episode, then what :func:`turn_record` holds."""
        line = {
            "format": FORMAT,
            "episode": turn.episode,
            "task": turn.task,
            "turn": turn.index,
            "segment": turn.segment,
            "continues": turn.continues,
            "segment_reason": turn.segment_reason,
            "n_messages": len(turn.messages),
            "messages_digest": _digest(turn.messages),
            "started": turn.started,
            "finished": time.time(),
            **record,
        }
        return line

    # ----------------------------------------------------------------------------------------------- rewards
    def post_reward(self, body: Any) -> dict[str, Any]:
        """Store an episode's reward (``POST /v1/rewards``); client mistakes raise :class:`APIError`."""
        if not isinstance(body, dict) or set(body) - {"episode", "reward", "turn_rewards"}:
            raise APIError("the body must be an object with 'episode', 'reward' and optionally 'turn_rewards'")
        ep = body.get("episode")
        if not isinstance(ep, str) or "/" not in ep:
            raise APIError("'episode' must be the id a reply gave ('message.arpo.record.episode')", param="episode")
        scope, _, episode = ep.partition("/")
        if not re.fullmatch(r"anonymous|[0-9a-f]{24}", scope):
            raise APIError(f"'episode' has no valid scope: {json.dumps(ep)[:80]}", param="episode")
        check_episode_id(episode, "episode")
        reward = _finite(body.get("reward"), "reward")
        path = self.episode_path(scope, episode)
        turns = read_lines(path)
        if not turns:
            raise APIError(f"no episode {ep!r} is recorded here", param="episode", status=404, code="not_found")
        per_turn = body.get("turn_rewards")
        if per_turn is not None:
            if not isinstance(per_turn, list) or len(per_turn) != len(turns):
                raise APIError(
                    f"'turn_rewards' must be a list of one number per recorded turn ({len(turns)})",
                    param="turn_rewards",
                )
            per_turn = [_finite(v, f"turn_rewards[{i}]") for i, v in enumerate(per_turn)]
        late = time.time() - turns[-1]["finished"]
        if late > self.config.reward_deadline_s:
            raise APIError(
                f"the episode's reward deadline passed {late - self.config.reward_deadline_s:.0f} s ago (it is "
                "dropped from training)",
                param="episode",
                status=409,
                code="reward_deadline_passed",
            )
        record = {"format": FORMAT, "reward": reward, "turn_rewards": per_turn, "turns": len(turns), "at": time.time()}
        if not self._write_new(path.with_suffix(".reward.json"), record):
            raise APIError(f"the episode {ep!r} already has a reward", param="episode", status=409, code="conflict")
        with self._lock:
            self.counts["rewards"] += 1
        return {"episode": ep, "reward": reward, "turns": len(turns)}

    def _write_new(self, path: Path, record: dict[str, Any], replace: bool = False) -> bool:
        """Write ``path`` whole and durably (a temporary file, fsynced, then linked in); False when it exists."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(record).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            if replace:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # fails when it exists: a reward is written once
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
        return True


def _finite(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(f"'{name}' must be a finite number, got {json.dumps(v)[:80]}", param=name)
    return float(v)
