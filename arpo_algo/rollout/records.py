"""Recorded episodes (the folder ``arpo serve --record DIR`` writes) read back as training groups.

The layout and the writer are :mod:`serve.record`'s; this module holds what both sides read: the folder check
(:func:`private_folder`), the line reader that skips a torn last line (:func:`read_lines`), the folder survey
(:func:`read_episodes`) and the learner's source of groups (:class:`RecordSource`).

How an episode becomes training data:

- An episode is *closed* by its reward (``<episode>.reward.json``, written once). Only closed episodes are read for
  training, and only their first ``reward["turns"]`` turns (the ones the reward was given for): a turn the server
  appended while the reward was being written is never trained. An episode with no reward is *pending* while its
  last turn is younger than the folder's reward deadline (left for a later iteration) and *dropped* afterwards
  (:data:`DROP_GRACE_S` later, so that a reward accepted at the deadline is never missed).
- Each segment (a token-continuous run of turns) is laid out as one sequence: its first prompt, then every turn's
  new prompt tokens (mask 0) and the reply a later turn continued (its own trained mask and recorded log-probs). A
  reply no later turn of the segment continued ends a sequence: with one choice per request, one sequence per
  segment. Every sequence carries its episode's reward.
- A choice the server marked unscoreable keeps its tokens as context with mask 0 (never trained) and is counted.
- Episodes are grouped by the task the client named (``arpo.task``), else by their first prompt's token ids, within
  the client's scope: a group trains with GRPO advantages over its episodes' rewards (one reward per episode, however
  many sequences it has). A group needs two rewarded episodes; a lone one is held while an episode of its group is
  pending or its reward is younger than the deadline, then dropped and counted.
- A closed episode that is not a valid record (a line that is not a turn, ids outside the vocabulary, log-probs that
  are not finite, a continued turn that does not extend its segment) is skipped, logged and counted.

Every episode is consumed once: trained, dropped or skipped. The consumed set is the source's state, saved in the same
checkpoint as the weights and optimizer, so a resumed run neither trains an episode twice nor misses one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_algo.rollout import metrics as MK
from arpo_algo.rollout.types import Group, Trajectory
from arpo_base.errors import ArpoError, ConfigError

log = logging.getLogger("arpo.records")

#: The folder's settings file (the reward deadline) and the record format this reader knows.
SETTINGS = "record.json"
FORMAT = 1
DEFAULT_REWARD_DEADLINE_S = 24 * 3600.0
#: Seconds past the deadline before an episode without a reward is dropped: a reward the server accepted just inside
#: the deadline is on disk by then, so the trainer never drops an episode the server rewarded.
DROP_GRACE_S = 60.0
#: The counts a source reports (under ``rollout/records/`` in the run's metrics), each an episode or choice count.
COUNTS = ("trained", "pending", "held", "dropped", "singletons", "malformed", "untrainable", "unscoreable")


def private_folder(path: str | Path, *, create: bool = True) -> Path:
    """``path`` made (0700) or checked: refused when another user owns it or may write into it (anyone who can
    write there could forge episodes and rewards)."""
    p = Path(path).expanduser()
    if create:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
    elif not p.is_dir():
        raise ConfigError(f"the record folder {p} does not exist", hint="give the folder `arpo serve --record` wrote")
    st = p.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(f"the record folder {p} belongs to another user", hint="give a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"the record folder {p} is writable by other users (they could forge episodes)", hint=f"chmod 700 {p}"
        )
    return p


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a record file; a torn (unfinished or unparsable) last line is skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = [line for line in data.split(b"\n") if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a write the process did not finish: the turn was never answered
                log.warning("skipping a torn last line in %s", path.name)
                continue
            raise ConfigError(f"the record file {path.name} has a damaged line {i + 1}") from None
    return out


def reward_deadline(root: Path) -> float:
    """The reward deadline the folder's server announced in ``record.json``."""
    settings = json.loads((root / SETTINGS).read_text()) if (root / SETTINGS).exists() else {}
    return float(settings.get("reward_deadline_s", DEFAULT_REWARD_DEADLINE_S))


def read_episodes(root: str | Path, now: float | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every recorded episode of a folder with its turns and reward, and counts. An episode with no reward past the
    deadline in ``record.json`` is marked ``dropped`` (counted); one still within it ``pending``."""
    root = private_folder(root)
    deadline = reward_deadline(root)
    now = time.time() if now is None else now
    out, counts = [], {"rewarded": 0, "pending": 0, "dropped": 0, "turns": 0, "unscoreable_turns": 0}
    for path in sorted(root.glob("*/*.jsonl")):
        turns = read_lines(path)
        if not turns:
            continue
        reward_path = path.with_suffix(".reward.json")
        reward = json.loads(reward_path.read_text()) if reward_path.exists() else None
        if reward is not None:
            status = "rewarded"
        else:
            status = "dropped" if now - turns[-1]["finished"] > deadline else "pending"
        counts[status] += 1
        counts["turns"] += len(turns)
        counts["unscoreable_turns"] += sum(any(c["unscoreable"] for c in t["choices"]) for t in turns)
        out.append({"episode": f"{path.parent.name}/{path.stem}", "status": status, "turns": turns, "reward": reward})
    return out, counts


class Malformed(ValueError):
    """A closed episode that is not a valid record (skipped and counted, never trained)."""


@dataclass
class Sequence:
    """One training sequence of an episode: all its tokens, their trained mask and recorded log-probs (0.0 where
    not trained), and the first position a prompt may not cover (the first trained token)."""

    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    finish: str


@dataclass
class Episode:
    """A closed episode read for training."""

    name: str
    key: str
    reward: float
    rewarded_at: float
    sequences: list[Sequence]
    unscoreable: int


def _ids(value: Any, vocab: int, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise Malformed(f"{what} is not a list of token ids")
    if value and (min(value) < 0 or max(value) >= vocab):
        raise Malformed(f"{what} holds ids outside the model's vocabulary (size {vocab}): another tokenizer's record")
    return value


def _choice(choice: Any, vocab: int, where: str) -> tuple[list[int], list[int], list[float], str | None]:
    """A recorded choice's ids, mask and per-token log-probs, and why it cannot be trained (None: it can)."""
    if not isinstance(choice, dict):
        raise Malformed(f"{where} is not a choice")
    ids = _ids(choice.get("response_ids"), vocab, f"{where}'s response_ids")
    mask = choice.get("trained_mask")
    if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
        raise Malformed(f"{where}'s trained_mask is not one 0 or 1 per response token")
    why = choice.get("unscoreable")
    if why is not None and not isinstance(why, str):
        raise Malformed(f"{where}'s unscoreable mark is not a reason")
    values = choice.get("logprobs")
    if why is None and not (isinstance(values, list) and len(values) == sum(mask)):
        why = "its log-probs do not cover its trained tokens"  # e.g. an end token the engine appended unsampled
    if why is not None or not isinstance(values, list):
        return ids, [0] * len(ids), [0.0] * len(ids), why
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise Malformed(f"{where}'s log-probs are not finite numbers")
    it = iter(values)
    return ids, list(mask), [float(next(it)) if m else 0.0 for m in mask], None


def episode_sequences(turns: list[dict[str, Any]], vocab: int) -> tuple[list[Sequence], int]:
    """The training sequences of a closed episode's turns (see the module docstring) and its unscoreable choices."""
    out, unscoreable, i = [], 0, 0
    while i < len(turns):
        segment = turns[i].get("segment")
        j = i
        while j < len(turns) and turns[j].get("segment") == segment:
            j += 1
        seqs, bad = _segment(turns[i:j], vocab)
        out += seqs
        unscoreable += bad
        i = j
    return out, unscoreable


def _segment(turns: list[dict[str, Any]], vocab: int) -> tuple[list[Sequence], int]:
    ctx: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    out, unscoreable = [], 0
    for k, turn in enumerate(turns):
        where = f"turn {turn.get('turn', k)}"
        if not isinstance(turn, dict) or not isinstance(turn.get("choices"), list) or not turn["choices"]:
            raise Malformed(f"{where} has no choices")
        prompt = _ids(turn.get("prompt_ids"), vocab, f"{where}'s prompt_ids")
        if prompt[: len(ctx)] != ctx:
            raise Malformed(f"{where} continues its segment but does not extend its tokens")
        extra = len(prompt) - len(ctx)
        base = (prompt, mask + [0] * extra, lps + [0.0] * extra)
        nxt = turns[k + 1].get("prompt_ids") if k + 1 < len(turns) else None
        continued = None
        for c, choice in enumerate(turn["choices"]):
            ids, m, lp, why = _choice(choice, vocab, f"{where} choice {c}")
            unscoreable += why is not None
            full = (base[0] + ids, base[1] + m, base[2] + lp)
            if continued is None and isinstance(nxt, list) and nxt[: len(full[0])] == full[0]:
                continued = full
            elif any(full[1]):
                out.append(Sequence(*full, finish=str(choice.get("finish_reason") or "")))
        if nxt is not None and continued is None:
            raise Malformed(f"turn {turns[k + 1].get('turn', k + 1)} continues no reply of {where}")
        if continued is not None:
            ctx, mask, lps = continued
    return out, unscoreable


def group_key(scope: str, first: dict[str, Any]) -> str:
    """The group of an episode: its client's scope and the task it named, else a hash of its first prompt."""
    task = first.get("task")
    if isinstance(task, str) and task:
        return f"{scope}/task:{task}"
    digest = hashlib.sha256(json.dumps(first.get("prompt_ids")).encode()).hexdigest()[:16]
    return f"{scope}/prompt:{digest}"


def record_source(settings: Any, tokenizer: Any) -> RecordSource | None:
    """The recorded episodes a run trains on (``training.records``), or None: it samples its own."""
    if settings.training.records is None:
        return None
    return RecordSource(settings.training.records, len(tokenizer))


class RecordSource:
    """The learner's groups from a record folder, each episode consumed once (see the module docstring)."""

    def __init__(self, folder: str | Path, vocab_size: int) -> None:
        self.root = private_folder(folder, create=False)
        self.vocab_size = vocab_size
        self.consumed: set[str] = set()
        self.totals = dict.fromkeys(COUNTS, 0)
        self.groups_taken = 0

    def get_state(self) -> dict[str, Any]:
        return {"consumed": sorted(self.consumed), "totals": dict(self.totals), "groups": self.groups_taken}

    def set_state(self, state: dict[str, Any]) -> None:
        self.consumed = set(state["consumed"])
        self.totals = dict.fromkeys(COUNTS, 0) | {k: int(v) for k, v in state["totals"].items() if k in COUNTS}
        self.groups_taken = int(state["groups"])

    def _consume(self, name: str, count: str, n: int = 1) -> None:
        self.consumed.add(name)
        self.totals[count] += n

    def _survey(self, now: float) -> tuple[dict[str, list[Episode]], dict[str, int]]:
        """The closed episodes not yet consumed, by group, and how many pending episodes each group has (episodes
        found dropped or malformed are consumed and counted here)."""
        deadline = reward_deadline(self.root)
        closed: dict[str, list[Episode]] = defaultdict(list)
        pending: dict[str, int] = defaultdict(int)
        for path in sorted(self.root.glob("*/*.jsonl")):
            name = f"{path.parent.name}/{path.stem}"
            if name in self.consumed:
                continue
            reward_path = path.with_suffix(".reward.json")
            rewarded = reward_path.exists()  # checked before the turns are read: the reward closes the episode
            try:
                turns = read_lines(path)
                if not turns:
                    continue
                if not rewarded:
                    if now - float(turns[-1]["finished"]) > deadline + DROP_GRACE_S:
                        log.warning("episode %s got no reward within the deadline: dropped", name)
                        self._consume(name, "dropped")
                    else:
                        pending[group_key(path.parent.name, turns[0])] += 1
                    continue
                episode = self._episode(name, path.parent.name, turns, json.loads(reward_path.read_text()))
            except (Malformed, ConfigError, KeyError, TypeError, ValueError) as e:
                log.warning("skipping the recorded episode %s: %s", name, e)
                self._consume(name, "malformed")
                continue
            closed[episode.key].append(episode)
        return closed, pending

    def _episode(self, name: str, scope: str, turns: list[dict[str, Any]], reward: Any) -> Episode:
        if not isinstance(reward, dict) or not isinstance(reward.get("turns"), int) or reward["turns"] < 1:
            raise Malformed("its reward file is not a reward")
        if reward["turns"] > len(turns):
            raise Malformed(f"its reward names {reward['turns']} turns and {len(turns)} are recorded")
        turns = turns[: reward["turns"]]  # turns appended while the reward was being written are not its
        if any(not isinstance(t, dict) or t.get("format") != FORMAT for t in turns):
            raise Malformed(f"a line is not a turn of record format {FORMAT}")
        sequences, unscoreable = episode_sequences(turns, self.vocab_size)
        value = reward.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise Malformed("its reward is not a finite number")
        at = float(reward.get("at", 0.0))
        return Episode(name, group_key(scope, turns[0]), float(value), at, sequences, unscoreable)

    def take(self, limit: int, version: int, now: float | None = None) -> tuple[list[Group], dict[str, float]]:
        """Up to ``limit`` groups ready to train (oldest rewards first), their episodes consumed, and the metrics:
        the batch's rollout metrics and the source's counts (``rollout/records/<count>``: totals over the run, and
        the pending and held episodes as found now). ``version``: the learner's policy version, which the groups
        carry (the served weights that sampled them have no version of this run)."""
        now = time.time() if now is None else now
        closed, pending = self._survey(now)
        deadline = reward_deadline(self.root)
        ready, held = [], 0
        for key, episodes in closed.items():
            trainable = [e for e in episodes if e.sequences]
            for e in episodes:
                if not e.sequences:  # no choice of it can be trained (each one unscoreable)
                    self._consume(e.name, "untrainable")
                    self.totals["unscoreable"] += e.unscoreable
            if len(trainable) >= 2:
                ready.append((min(e.rewarded_at for e in trainable), key, trainable))
            elif trainable and (pending[key] or now - trainable[0].rewarded_at <= deadline):
                held += 1  # a lone rewarded episode waits for another of its group
            elif trainable:
                log.warning("episode %s is the only rewarded one of its group: dropped", trainable[0].name)
                self._consume(trainable[0].name, "singletons")
        groups = []
        for _, key, episodes in sorted(ready)[:limit]:
            group = self._group(key, episodes, version)
            if group is None:
                continue
            for e in episodes:
                self._consume(e.name, "trained")
                self.totals["unscoreable"] += e.unscoreable
            groups.append(group)
        self.totals["pending"], self.totals["held"] = sum(pending.values()), held
        metrics = MK.summarize(groups) if groups else {}
        metrics.update({f"{MK.ROLLOUT}records/{k}": float(v) for k, v in self.totals.items()})
        return groups, metrics

    def _group(self, key: str, episodes: list[Episode], version: int) -> Group | None:
        """One GRPO group: the sequences share the longest prompt no trained token falls in."""
        seqs = [(i, s) for i, e in enumerate(episodes) for s in e.sequences]
        first = seqs[0][1].ids
        cut = min(s.mask.index(1) for _, s in seqs)
        for _, s in seqs:
            cut = next((p for p in range(min(cut, len(s.ids))) if s.ids[p] != first[p]), cut)
        if cut < 1:  # the learner scores a response's first token from the prompt before it
            log.warning("the episodes of group %s share no first token: skipped", key)
            for e in episodes:
                self._consume(e.name, "malformed")
            return None
        trajs = [
            Trajectory(
                traj_id=j,
                response_ids=s.ids[cut:],
                trained_mask=s.mask[cut:],
                old_logprobs=s.logprobs[cut:],
                entropies=[0.0] * (len(s.ids) - cut),
                reward=episodes[i].reward,
                reward_info={"episode": episodes[i].name},
                finish_reason=s.finish,
                policy_version=version,
            )
            for j, (i, s) in enumerate(seqs)
        ]
        index = self.groups_taken
        self.groups_taken += 1
        task = {"id": key, "source": "records", "record_episodes": [i for i, _ in seqs]}
        return Group(prompt_index=index, prompt_ids=first[:cut], trajectories=trajs, task=task, policy_version=version)

    def wait(self, limit: int, version: int, wait_s: float) -> tuple[list[Group], dict[str, float], float]:
        """:meth:`take`, polling for up to ``wait_s`` seconds until a group is ready; also the seconds waited.

        Raises:
            ArpoError: when none is ready by then (the run stops; its last checkpoint holds its position).
        """
        t0 = time.perf_counter()
        while True:
            groups, metrics = self.take(limit, version)
            waited = time.perf_counter() - t0
            if groups:
                return groups, metrics, waited
            if waited >= wait_s:
                counts = ", ".join(f"{k} {v}" for k, v in self.totals.items())
                raise ArpoError(
                    f"no group of recorded episodes in {self.root} is ready to train (episodes: {counts})",
                    hint="a group needs two rewarded episodes of one task: post their rewards, or let the run wait "
                    "for them with training.records_wait_s",
                )
            time.sleep(min(2.0, wait_s - waited))
