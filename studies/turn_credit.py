"""Is the tree's turn credit unbiased when the policy decides when to stop? Exact, by enumerating every tree.

A synthetic agent answers or calls a tool at each turn: at turn k it stops with probability ``p[k]`` and is then
right (reward 1) with probability ``q[k]``, else it calls a tool and goes on to turn k + 1 (the last turn always
stops). The exact values are ``V[k] = p[k] q[k] + (1 - p[k]) V[k+1]``, so a turn's exact advantage is ``q[k] - V[k]``
for stopping and ``V[k+1] - V[k]`` for going on.

Each group is a tree as ARPO samples one: the prompt has ``m`` independent samples, and every tool result branches
``m`` ways (the first child continues its trajectory, the others are branches from it). Every such tree is enumerated
with its probability, each is handed to the registered ``"turn"`` estimator as token-level trajectories with their
branch points, and the table gives, per turn and action, the expected advantage a turn receives (expected sum over
the group's turns of that kind over their expected count), next to the exact value and two other baselines:

* ``leaf mean``: a node valued by the plain mean reward of the trajectories under it;
* ``per-turn index``: a turn at index k valued against the mean reward of every trajectory that reached index k.

A turn's own sample is part of its node's value (as a trajectory is part of its GRPO group's mean), which shrinks
every advantage by ``(m - 1) / m``. So every baseline column is in leave-one-out form (the baseline leaves out the
turn's own subtree), comparable with the exact column; for ``turn`` that form is exactly ``m / (m - 1)`` times what
it trains on, shown as ``turn (trained)``.

    python -m studies.turn_credit                       # the table of docs/concepts/arpo.md#turn-credit
    python -m studies.turn_credit --p 0.3 0.6 1 --q 0.1 0.5 0.8
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from arpo_algo.core.advantages import ADVANTAGES, tree_token_owners

STOP, GO = "stop", "go on"
MAX_TREES = 100_000


def tree_count(turns: int, m: int) -> int:
    """How many trees :func:`node_outcomes` enumerates for ``turns`` turns (at most; a zero probability drops some)."""
    node = 0
    for _ in range(turns):
        node = (2 + node) ** m
    return node


def child_outcomes(k: int, p: list[float], q: list[float], m: int) -> list[tuple[float, tuple]]:
    """Every outcome of one sample at turn ``k`` with its probability: ``(STOP, reward)`` or ``(GO, node)``."""
    out = [(p[k] * q[k], (STOP, 1.0)), (p[k] * (1 - q[k]), (STOP, 0.0))]
    if p[k] < 1:
        out += [((1 - p[k]) * w, (GO, node)) for w, node in node_outcomes(k + 1, p, q, m)]
    return [(w, c) for w, c in out if w > 0]


def node_outcomes(k: int, p: list[float], q: list[float], m: int) -> list[tuple[float, tuple]]:
    """Every outcome of a node at turn ``k`` (its ``m`` independent samples) with its probability."""
    one = child_outcomes(k, p, q, m)
    out = []
    for combo in itertools.product(one, repeat=m):
        w = 1.0
        for cw, _ in combo:
            w *= cw
        out.append((w, tuple(c for _, c in combo)))
    return out


def tree_group(root: tuple) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A tree as trajectories (a turn is one trained token, a tool result one untrained token) and its turns.

    Returns ``(trajectories, turns)``: per trajectory its tokens, mask, parent, branch point and reward; per turn its
    index k, action, response position, the trajectories under it, its node's sample count m and the trajectories
    under its node.
    """
    trajs: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []

    def new(tokens: list[int], mask: list[int], parent: int | None) -> int:
        trajs.append({"tokens": list(tokens), "mask": list(mask), "parent": parent, "bp": None, "reward": 0.0})
        if parent is not None:
            trajs[-1]["bp"] = len(tokens)
        return len(trajs) - 1

    def walk(node: tuple, k: int, tid: int | None) -> list[int]:
        prefix = ([], []) if tid is None else (list(trajs[tid]["tokens"]), list(trajs[tid]["mask"]))
        ids = [tid if (i == 0 and tid is not None) else new(*prefix, tid) for i in range(len(node))]
        leaves: list[int] = []
        mine = []
        for t, (action, payload) in zip(ids, node):
            pos = len(trajs[t]["tokens"])
            trajs[t]["tokens"].append(10 * k + (1 if action == STOP else 2))
            trajs[t]["mask"].append(1)
            if action == STOP:
                trajs[t]["reward"] = payload
                under = [t]
            else:
                trajs[t]["tokens"].append(0)  # the tool result
                trajs[t]["mask"].append(0)
                under = walk(payload, k + 1, t)
            mine.append({"k": k, "action": action, "pos": pos, "under": under, "m": len(node)})
            leaves += under
        for u in mine:
            u["node_leaves"] = leaves
        turns.extend(mine)
        return leaves

    walk(root, 0, None)
    return trajs, turns


def turn_values(trajs: list[dict[str, Any]], turns: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per turn, the advantage each estimator gives it (leave-one-out forms, see the module docstring)."""
    rewards = [t["reward"] for t in trajs]
    owners = tree_token_owners(
        [t["parent"] for t in trajs], [t["bp"] for t in trajs], [len(t["tokens"]) for t in trajs]
    )
    tok = ADVANTAGES.lookup("turn")(
        [], [t["tokens"] for t in trajs], [t["mask"] for t in trajs], rewards, norm_by_std=False, owners=owners
    ).advantages
    mean = lambda ids: sum(rewards[i] for i in ids) / len(ids)  # noqa: E731
    reached = {k: [i for i, t in enumerate(trajs) if sum(t["mask"]) > k] for k in {u["k"] for u in turns}}
    out: dict[str, list[float]] = {"turn (trained)": [], "turn": [], "leaf mean": [], "per-turn index": []}
    for u in turns:
        shared = {tok[i][u["pos"]] for i in u["under"]}
        assert len(shared) == 1, "a turn's tokens shared by several trajectories carry one advantage"
        a = shared.pop()
        m = u["m"]
        out["turn (trained)"].append(a)
        out["turn"].append(a * m / (m - 1))
        rest = [i for i in u["node_leaves"] if i not in u["under"]]
        out["leaf mean"].append(mean(u["under"]) - mean(rest))
        others = [i for i in reached[u["k"]] if i not in u["under"]]
        out["per-turn index"].append(mean(u["under"]) - mean(others))
    return out


def exact_advantages(p: list[float], q: list[float]) -> dict[tuple[int, str], float]:
    """Per (turn, action), the exact advantage Q - V of the process."""
    v = [0.0] * len(p)
    for k in reversed(range(len(p))):
        v[k] = p[k] * q[k] + (1 - p[k]) * (v[k + 1] if k + 1 < len(p) else 0.0)
    out = {}
    for k in range(len(p)):
        if p[k] > 0:
            out[(k, STOP)] = q[k] - v[k]
        if p[k] < 1:
            out[(k, GO)] = v[k + 1] - v[k]
    return out


def bias_table(p: list[float], q: list[float], m: int = 2) -> list[dict[str, Any]]:
    """Per (turn, action): the exact advantage and each estimator's expected advantage, over every tree exactly."""
    if len(p) != len(q) or p[-1] != 1 or m < 2:
        raise ValueError("p and q need one value per turn, the last turn must stop (p[-1] = 1), and m >= 2")
    if (n := tree_count(len(p), m)) > MAX_TREES:
        raise ValueError(f"{n} trees to enumerate (at most {MAX_TREES}): fewer turns or a smaller m")
    sums: dict[tuple[int, str], dict[str, float]] = {}
    counts: dict[tuple[int, str], float] = {}
    for w, root in node_outcomes(0, p, q, m):
        trajs, turns = tree_group(root)
        vals = turn_values(trajs, turns)
        for i, u in enumerate(turns):
            key = (u["k"], u["action"])
            counts[key] = counts.get(key, 0.0) + w
            row = sums.setdefault(key, {})
            for name, col in vals.items():
                row[name] = row.get(name, 0.0) + w * col[i]
    exact = exact_advantages(p, q)
    return [
        {"k": k, "action": a, "exact": exact[(k, a)], **{n: s / counts[(k, a)] for n, s in sums[(k, a)].items()}}
        for (k, a) in sorted(sums, key=lambda x: (x[0], x[1] != STOP))
    ]


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = ["exact", "turn", "turn (trained)", "leaf mean", "per-turn index"]
    lines = ["| turn | action | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for r in rows:
        lines.append(f"| {r['k']} | {r['action']} | " + " | ".join(f"{r[c]:+.4f}" for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=float, nargs="+", default=[0.5, 0.5, 1.0], help="stop probability per turn")
    ap.add_argument("--q", type=float, nargs="+", default=[0.2, 0.5, 0.9], help="success probability per turn")
    ap.add_argument("--m", type=int, default=2, help="samples per node (independent samples, branches per result)")
    args = ap.parse_args(argv)
    print(f"p = {args.p}, q = {args.q}, m = {args.m}")
    print(markdown(bias_table(args.p, args.q, args.m)))


if __name__ == "__main__":
    main()
