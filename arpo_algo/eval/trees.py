"""Rollout trees on disk: the one writer (training records every iteration's groups after its update) and the reader
``arpo view`` serves them from.

A tree folder (``trees/`` in a run folder) holds, format version :data:`VERSION`:

* ``format.json``: ``{"format": "arpo-trees", "version": 1, "source": "train"}``, written first (``"eval"``: an
  evaluation's model, whose "iteration" n holds item n - 1's runs, :func:`eval_group`).
* ``iter_000007.jsonl``: one iteration's recorded groups, one JSON object per line (:func:`group_record`): the prompt
  and task, the nodes of the sampling tree (token range, decoded text in model and tool runs, the mean advantage of
  the trajectories through it, under turn credit its value and its turns, at a branch point the entropy before and
  after and the branch rule's decisions that made it), every branch decision of the tree (the entropies compared,
  the rule's constants, the random draws, the clones made; those that made no clone too), and the trajectories
  (token ids, trained mask, sampled log-prob and entropy per token, per-token advantage, under turn credit its
  path's node values (``turn_values``, else null), the learner's log-prob of each trained token before the update's
  first step (null for tool-result tokens; the whole list null where the learner is remote or the source is an
  evaluation), reward, finish reason, tool calls, the policy version that sampled it).
* ``index.jsonl``: one line per recorded iteration, appended after its chunk is complete: the chunk's name, each
  group's byte offset and length in it and a summary for the filters (solved / failed / branched / tool limit).

Invariant: an index line is written only after its chunk is flushed, so a reader trusts only what an index line
names; a torn last index line or a chunk shorter than its index says (a crash mid-write) is skipped, never guessed at.
A re-run iteration (after a resume) rewrites its chunk and appends a new index line; the last line wins.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Any

from arpo_base.errors import ArpoError

FORMAT = "arpo-trees"
VERSION = 1
FOLDER = "trees"
INDEX = "index.jsonl"
K = 10  # sampled tokens per entropy window at a branch point (before it, and at the start of each child)
SOLVED = 0.5  # a trajectory whose reward is above this counts as solved in the summaries and the page


def _r(x: float) -> float | None:
    """Four decimals keep the files small; NaN (a token the sampler appended without sampling it) becomes null."""
    return None if x is None or not math.isfinite(x) else round(float(x), 4)


def _rounded(xs: list[float]) -> list[float | None]:
    """:func:`_r` over a whole list, vectorised (the writer's cost is mostly these lists)."""
    import numpy as np

    a = np.round(np.asarray(xs, dtype=np.float64), 4)
    out = a.tolist()
    if not bool(np.isfinite(a).all()):
        out = [v if math.isfinite(v) else None for v in out]
    return out


def _clean(x: Any) -> Any:
    """Plain JSON (a browser's JSON.parse refuses NaN): non-finite floats become null, unknown objects their repr."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    return repr(x)


def _mean(xs: list[float]) -> float | None:
    return _r(sum(xs) / len(xs)) if xs else None


def _runs(ids: list[int], mask: list[int], decode: Any) -> list[list[str]]:
    """Token runs of one node as ``[kind, text]``: "model" for sampled tokens, "tool" for inserted tool results."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        out.append(["model" if mask[i] else "tool", decode(ids[i:j])])
        i = j
    return out


def _shared_filled(g: Any, through: dict[int, list[int]], learner: list[list[float]]) -> list[list[float]]:
    """A node's tokens are one sample shared by every trajectory through it (same prefix, same log-prob), and the
    learner may score such a token once (``merge_shared``): copy each position's value to the trajectories whose
    copy it did not score."""
    out = [list(v) for v in learner]
    row = {t.traj_id: k for k, t in enumerate(g.trajectories)}
    for n in g.nodes:
        rows = [out[row[tid]] for tid in through.get(n.node_id, [])]
        for i in range(n.start, n.end):
            have = next((r[i] for r in rows if i < len(r) and math.isfinite(r[i])), None)
            if have is not None:
                for r in rows:
                    if i < len(r) and not math.isfinite(r[i]):
                        r[i] = have
    return out


def _node_turns(n: Any, path: list[tuple[int, float]], adv: list[float] | None, mask: list[int]) -> dict:
    """A sampler node's value (the tree value where it ends; every node of the sampling tree ends where the valued
    tree has a node, a branch point or a trajectory's end) and the turns inside it as ``[start, end, value before,
    value after, advantage]``, the advantage as trained (null where the turn has no trained token)."""
    at = dict(path)
    turns = []
    for (a, va), (b, vb) in zip(path, path[1:]):
        if n.start <= a < n.end:
            first = next((t for t in range(a, b) if mask[t]), None)
            turns.append([a, b, _r(va), _r(vb), _r(adv[first]) if adv is not None and first is not None else None])
    return {"value": _r(at[n.end]) if n.end in at else None, "turns": turns}


def group_record(
    g: Any,
    iteration: int,
    index: int,
    decode: Any,
    advantages: list[list[float]] | None,
    learner: list[list[float]] | None = None,
    values: list[list[tuple[int, float]]] | None = None,
) -> dict:
    """One group as the JSON object a chunk line holds (see the module docstring); ``learner``: per trajectory, the
    learner's log-prob of each response token (NaN where it scored none), or None (not recorded); ``values``: per
    trajectory, its path's node values (``TokenAdvantages.values``), or None."""
    trajs = {t.traj_id: t for t in g.trajectories}
    children: dict[int | None, list[int]] = {}
    for n in g.nodes:
        children.setdefault(n.parent, []).append(n.node_id)
    through: dict[int, list[int]] = {}
    for t in g.trajectories:
        for nid in t.node_ids:
            through.setdefault(nid, []).append(t.traj_id)
    adv = {t.traj_id: a for t, a in zip(g.trajectories, advantages)} if advantages is not None else {}
    val = {t.traj_id: v for t, v in zip(g.trajectories, values)} if values is not None else {}
    start_of = {n.node_id: n.start for n in g.nodes}
    decisions = getattr(g, "decisions", [])
    nodes = []
    for n in g.nodes:
        owner = trajs[through[n.node_id][0]]
        ids, mask = owner.response_ids[n.start : n.end], owner.trained_mask[n.start : n.end]
        node: dict[str, Any] = {
            "id": n.node_id,
            "parent": n.parent,
            "start": n.start,
            "end": n.end,
            "depth": n.depth,
            "policy_version": n.policy_version,
            "text": _runs(ids, mask, decode),
            "trajectories": through[n.node_id],
        }
        if adv:
            vals = [
                a
                for tid in through[n.node_id]
                for a, m in zip(adv[tid][n.start : n.end], trajs[tid].trained_mask[n.start : n.end])
                if m
            ]
            node["advantage"] = _mean(vals)
        if val:
            node.update(_node_turns(n, val[owner.traj_id], adv.get(owner.traj_id), owner.trained_mask))
        kids = children.get(n.node_id, [])
        if len(kids) > 1 and n.end > 0:  # the empty root's children are independent samples, not a branch
            before = [e for e, m in zip(owner.entropies[: n.end], owner.trained_mask[: n.end]) if m][-K:]
            after = []
            for c in kids:
                t = trajs[through[c][0]]
                s = start_of[c]
                after.append(_mean([e for e, m in zip(t.entropies[s:], t.trained_mask[s:]) if m][:K]))
            node["branch"] = {
                "entropy_before": _mean(before),
                "entropy_after": after,
                "children": kids,
                "decisions": [
                    _clean(d)
                    for d in decisions
                    if d["branches"] and d["at"] == n.end and d["trajectory"] in through[n.node_id]
                ],
            }
        nodes.append(node)
    if learner is not None:
        learner = _shared_filled(g, through, learner)
    out_trajs = []
    for k, t in enumerate(g.trajectories):
        out_trajs.append(
            {
                "id": t.traj_id,
                "kind": t.kind,
                "parent": t.parent,
                "branch_point": t.branch_point,
                "node_ids": t.node_ids,
                "reward": _r(t.reward),
                "reward_info": _clean(t.reward_info),
                "finish_reason": t.finish_reason,
                "tool_calls": _clean(t.tool_calls),
                "policy_version": t.policy_version,
                "response_ids": t.response_ids,
                "trained_mask": t.trained_mask,
                "sampled_logprobs": _rounded(t.old_logprobs),
                "entropies": _rounded(t.entropies),
                "learner_logprobs": _rounded(learner[k]) if learner is not None else None,
                "advantages": _rounded(adv[t.traj_id]) if adv else None,
                "turn_values": [[b, _r(v)] for b, v in val[t.traj_id]] if val else None,
                "segment_entropy": _rounded(t.segment_entropy),
            }
        )
    return {
        "iteration": iteration,
        "group": index,
        "prompt_index": g.prompt_index,
        "policy_version": g.policy_version,
        "task": _clean(g.task),
        "prompt": decode(g.prompt_ids),
        "prompt_ids": g.prompt_ids,
        "metrics": _clean(g.metrics),
        "nodes": nodes,
        "trajectories": out_trajs,
        "decisions": _clean(decisions),
    }


def eval_group(index: int, item: dict, runs: list[int], traces: list[Any], rewards: list[tuple[float, dict]]) -> Any:
    """An evaluation item's runs as a group of independent samples (a root node and one child per run), so
    ``arpo eval`` records them in the training's format: ``prompt_index`` is the item's index in the data, the task
    names the item, no policy version and no advantages."""
    from arpo_algo.rollout.types import Group, Trajectory, TreeNode

    trajs, nodes = [], [TreeNode(0, None, 0, 0, 0, None)]
    for k, (run, tr, (reward, info)) in enumerate(zip(runs, traces, rewards)):
        nodes.append(TreeNode(k + 1, 0, 0, len(tr.response_ids), 1, None))
        trajs.append(
            Trajectory(
                run,
                list(tr.response_ids),
                list(tr.trained_mask),
                list(tr.logprobs),
                list(tr.entropies),
                reward=reward,
                reward_info=info,
                tool_calls=tr.tool_calls,
                node_ids=[0, k + 1],
                finish_reason=tr.finish_reason,
                unsampled=list(tr.unsampled),
            )
        )
    task = {"item_id": item["id"], "question": item["question"], "ground_truth": item["ground_truth"]}
    return Group(index, list(traces[0].prompt_ids), trajs, task=task, nodes=nodes)


def token_advantages(groups: list[Any], training: Any) -> list[Any]:
    """Per group, the :class:`~arpo_algo.core.advantages.TokenAdvantages` before any entropy-aware shaping: the
    learner's own estimator call (:func:`~arpo_algo.train.update_stats.group_token_advantages`), so the recorded
    numbers are the ones it trained on (and the node values, for an estimator that gives them)."""
    from arpo_algo.train.update_stats import group_token_advantages

    return [group_token_advantages(g, training) for g in groups]


def summary(rec: dict) -> dict:
    """What the index keeps of a group: counts for the page's list and the filters."""
    rewards = [t["reward"] or 0.0 for t in rec["trajectories"]]
    parents = {n["parent"] for n in rec["nodes"]}
    return {
        "prompt_index": rec["prompt_index"],
        "policy_version": rec["policy_version"],
        "trajectories": len(rewards),
        "nodes": len(rec["nodes"]),
        "leaves": sum(n["id"] not in parents for n in rec["nodes"]),
        "branch_points": sum("branch" in n for n in rec["nodes"]),
        "solved": sum(r > SOLVED for r in rewards),
        "failed": sum(r <= SOLVED for r in rewards),
        "tool_limit": sum(t["finish_reason"] == "tool_limit" for t in rec["trajectories"]),
        "reward_mean": _mean(rewards),
        "prompt": rec["prompt"][-160:],
    }


def start_folder(folder: str | os.PathLike, source: str = "train") -> Path:
    """Create the tree folder and its ``format.json`` (kept when present), so a viewer can open it before the first
    iteration is recorded."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fmt = folder / "format.json"
    if not fmt.exists():
        fmt.write_text(json.dumps({"format": FORMAT, "version": VERSION, "source": source}) + "\n")
    return folder


class TreeWriter:
    """Writes one iteration's groups as a chunk plus its index line (see the module docstring).

    Args:
        folder: The tree folder (created).
        decode: token ids -> text (the policy's tokenizer).
        source: "train" or "eval".
        max_groups: At most this many groups per iteration (the first ones sampled); None: all.
        every: Record every n-th iteration (1: all).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        decode: Any,
        *,
        source: str = "train",
        max_groups: int | None = None,
        every: int = 1,
    ) -> None:
        self.folder = start_folder(folder, source)
        self.decode, self.max_groups, self.every = decode, max_groups, max(1, every)

    def record(
        self,
        iteration: int,
        groups: list[Any],
        advantages: list[list[list[float]]] | None = None,
        learner: list[list[list[float]]] | None = None,
        values: list[list[list[tuple[int, float]]] | None] | None = None,
    ) -> bool:
        """Write ``iteration``'s groups (``advantages``, ``learner``: per group, per trajectory, per token: the
        advantages and the learner's log-probs; ``values``: per group, the estimator's node values or None);
        False if skipped."""
        if iteration % self.every:
            return False
        t0 = time.perf_counter()
        chosen = groups if self.max_groups is None else groups[: self.max_groups]
        if advantages is not None:
            advantages = advantages[: len(chosen)]
        name = f"iter_{iteration:06d}.jsonl"
        entries, offset = [], 0
        with open(self.folder / name, "wb") as f:
            for i, g in enumerate(chosen):
                rec = group_record(
                    g,
                    iteration,
                    i,
                    self.decode,
                    advantages[i] if advantages is not None else None,
                    learner[i] if learner is not None else None,
                    values[i] if values is not None else None,
                )
                line = (json.dumps(rec, allow_nan=False) + "\n").encode()
                f.write(line)
                entries.append({"offset": offset, "length": len(line), **summary(rec)})
                offset += len(line)
            f.flush()
            os.fsync(f.fileno())
        row = {
            "iteration": iteration,
            "chunk": name,
            "sampled_groups": len(groups),
            "time": time.time(),
            "record_s": round(time.perf_counter() - t0, 4),
            "groups": entries,
        }
        with open(self.folder / INDEX, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        return True


def find_folder(path: str | os.PathLike) -> Path:
    """The tree folder of ``path`` (a run folder, an evaluation folder or the tree folder itself); a folder without
    trees is an error that says how to make them."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ArpoError(f"{p} does not exist", hint="give a run folder (arpo train's --output) or its trees/ folder")
    for cand in (p, p / FOLDER):
        if (cand / "format.json").is_file():
            return cand
    models = sorted(d for d in (p / FOLDER).glob("*") if (d / "format.json").is_file())  # an evaluation's
    if len(models) == 1:
        return models[0]
    if models:
        names = ", ".join(d.name for d in models)
        raise ArpoError(
            f"{p} holds the trees of several evaluated models ({names}): name one",
            hint=f"e.g. arpo view {models[0]}, or compare two: arpo view {models[0]} {models[1]}",
        )
    raise ArpoError(
        f"{p} holds no rollout trees (no {FOLDER}/format.json)",
        hint="training records them by default: run `arpo train EXPERIMENT --output FOLDER` "
        "(rollouts.record_trees = true) and view FOLDER",
    )


def sweep_trials(path: str | os.PathLike) -> list[Path]:
    """The tree folders of a sweep's trials, by trial folder name: ``path`` is a Tune experiment folder
    (``<trial>/trees``) or a folder of them (``arpo tune``'s output: ``<experiment>/<trial>/trees``). Empty when
    ``path`` itself holds trees or no trial does."""
    p = Path(path).expanduser()
    if (p / "format.json").is_file() or (p / FOLDER / "format.json").is_file():
        return []
    found = [f.parent for pattern in (f"*/{FOLDER}/format.json", f"*/*/{FOLDER}/format.json") for f in p.glob(pattern)]
    return sorted(found, key=lambda f: (f.parent.name, str(f)))


def _whole(*values: object) -> bool:
    """Every value a non-negative int (a bool is not)."""
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _chunk_name(name: str) -> bool:
    """Whether an index line's chunk is a plain file name of the tree folder (what :class:`TreeWriter` writes)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


class TreeReader:
    """Reads a tree folder: the index (incrementally, for a live run) and single groups by their offsets."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = find_folder(folder)
        try:
            fmt = json.loads((self.folder / "format.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ArpoError(f"{self.folder / 'format.json'} is not readable JSON ({e})") from None
        if not isinstance(fmt, dict) or fmt.get("format") != FORMAT or not isinstance(fmt.get("version"), int):
            raise ArpoError(f"{self.folder} is not an arpo tree folder (format.json says {fmt!r})")
        if fmt["version"] > VERSION:
            raise ArpoError(
                f"{self.folder} holds trees in format version {fmt['version']}; this arpo reads up to "
                f"version {VERSION}",
                hint="upgrade arpo to view them",
            )
        self.format = fmt
        self._pos = 0  # bytes of index.jsonl consumed (whole lines only)
        self.iterations: dict[int, dict] = {}

    def refresh(self) -> list[int]:
        """Read the index lines appended since the last call; returns the iterations they (re)wrote. A line without
        its newline yet (being written) waits for the next call; a line that is not JSON, or whose chunk is shorter
        than it says, is skipped."""
        try:
            with open(self.folder / INDEX, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._pos += end
        new = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
                iteration = row["iteration"]
                spans = [(e["offset"], e["length"]) for e in row["groups"]]
                if not _whole(iteration, *(v for span in spans for v in span)) or not isinstance(row["chunk"], str):
                    continue  # a line someone else wrote or edited: numbers that are not counts are not read
                need = max((o + n for o, n in spans), default=0)
                if not _chunk_name(row["chunk"]):
                    continue  # only a file of this folder is read: never a path, ``..`` or a folder
                info = os.stat(self.folder / row["chunk"], follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode) or info.st_size < need:
                    continue  # the chunk was cut after its index line: skip the iteration rather than guess
            except (ValueError, KeyError, TypeError, AttributeError, OSError):
                continue
            self.iterations[iteration] = row
            new.append(iteration)
        return new

    def group(self, iteration: int, index: int) -> dict:
        """One group's record (KeyError: not in the index; IndexError: no such group, a negative index included;
        ValueError: its bytes are not a record)."""
        row = self.iterations[iteration]
        if index < 0:
            raise IndexError(index)
        e = row["groups"][index]
        with open(self.folder / row["chunk"], "rb") as f:  # refresh() kept only a plain name of a regular file
            f.seek(e["offset"])
            return json.loads(f.read(e["length"]))
