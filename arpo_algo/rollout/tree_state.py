"""The state of sampling trees while they grow: a :class:`Path` per trajectory, a :class:`PromptState` per prompt, and
:func:`assemble_group`, which turns a finished prompt into its :class:`~arpo_algo.rollout.types.Group`.

A path is an agent-loop :class:`~arpo_algo.rollout.agent_loop.Conversation` (tokens, tool calls, cache keys) plus its
place in the tree and what the branch rule needs; :class:`arpo_algo.rollout.sampler.TreeSampler` drives them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from arpo_algo.core import tree as T
from arpo_algo.rollout import metrics as MK
from arpo_algo.rollout.agent_loop import Conversation
from arpo_algo.rollout.types import Group, Trajectory


@dataclasses.dataclass(eq=False, kw_only=True)
class Path(Conversation):
    """One trajectory while it grows: a :class:`~arpo_algo.rollout.agent_loop.Conversation` with its place in the
    tree and what the branch rule needs (becomes a :class:`Trajectory` at the end)."""

    tid: int
    batch_index: int  # index over the whole sample() call: the reference's entropy-dict key
    env: Any
    kind: str
    parent: int | None = None
    branch_point: int | None = None
    depth: int = 0
    consecutive: int = 0  # consecutive branching steps of this path (the penalty counter, path scope)
    inherited_calls: int = 0  # tool calls copied from the parent (made once, on the shared prefix)
    h_init: float | None = None
    turn_h: float | None = None  # entropy of the latest turn's first segment (what the rule sees)
    h_root: float | None = None
    h_after_tool: float | None = None
    segment_entropy: list[float] = dataclasses.field(default_factory=list)
    lookahead: bool = False  # paper rule: the next request is the k-token look-ahead
    reward: float = 0.0
    reward_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    ent_before: list[float] = dataclasses.field(default_factory=list)
    ent_after: list[float] = dataclasses.field(default_factory=list)

    def finish(self, reason: str, reward: float, info: dict[str, Any]) -> None:
        self.done, self.finish_reason, self.reward, self.reward_info = True, reason, reward, info
        if self.engine_error:
            self.reward_info["engine_error"] = self.engine_error

    def record_turn_entropy(self, h: float, cfg: T.TreeConfig, stale: dict[int, float], k_ents: list[float]) -> None:
        self.turn_h = h
        self.segment_entropy.append(h)
        if self.turn_start == 0 and self.parent is None:
            self.h_root = h
        elif self.turn_start > 0:
            self.h_after_tool = h if self.h_after_tool is None else self.h_after_tool
            self.ent_after.append(MK.mean(k_ents))
        if self.h_init is None:
            self.h_init = stale.setdefault(self.batch_index, h) if cfg.legacy_stale_baseline else h

    def copy_prefix(self, bp: int, tid: int, batch_index: int, env: Any, key: Any) -> Path:
        return Path(
            tid=tid,
            batch_index=batch_index,
            env=env,
            kind="branch",
            response=self.response[:bp],
            mask=self.mask[:bp],
            logprobs=self.logprobs[:bp],
            entropies=self.entropies[:bp],
            tool_calls=[dict(c) for c in self.tool_calls],
            inherited_calls=len(self.tool_calls),
            parent=self.tid,
            branch_point=bp,
            depth=self.depth + 1,
            consecutive=self.consecutive,
            h_init=self.h_init,
            turn_start=bp,
            cache_key=key,
            unsampled=[i for i in self.unsampled if i < bp],
        )

    def to_trajectory(self) -> Trajectory:
        return Trajectory(
            traj_id=self.tid,
            response_ids=self.response,
            trained_mask=self.mask,
            old_logprobs=self.logprobs,
            entropies=self.entropies,
            reward=self.reward,
            reward_info=self.reward_info,
            tool_calls=self.tool_calls,
            parent=self.parent,
            branch_point=self.branch_point,
            kind=self.kind,
            finish_reason=self.finish_reason,
            segment_entropy=self.segment_entropy,
            unsampled=list(self.unsampled),
        )


@dataclasses.dataclass(eq=False)
class PromptState:
    """One prompt's tree while it grows."""

    task_index: int
    prompt_ids: list[int]
    template: Any  # the reset environment every initial sample and fill-up clones
    task: dict[str, Any]
    step: int
    rng: Any
    paths: list[Path] = dataclasses.field(default_factory=list)
    count: int = 0
    consecutive: int = 0  # consecutive rounds that gained a trajectory (the penalty counter, prompt scope)
    m: int | None = None
    pending_m: bool = False
    branches_by_depth: Counter = dataclasses.field(default_factory=Counter)
    premonitor_tool_calls: int = 0
    premonitor_tokens: int = 0
    decisions: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # branch decisions, as Group.decisions


def assemble_group(ps: PromptState, step: int, policy_version: int | None = None) -> Group:
    """The finished tree of one prompt as a :class:`Group` (nodes built by :func:`arpo_algo.core.tree.build_tree`);
    the tree, each node and each trajectory carry ``policy_version`` (a tree is sampled under one version)."""
    trajs = [p.to_trajectory() for p in ps.paths]
    nodes, node_ids = T.build_tree(
        [t.parent for t in trajs], [t.branch_point for t in trajs], [len(t.response_ids) for t in trajs]
    )
    for t, ids in zip(trajs, node_ids):
        t.node_ids, t.policy_version = ids, policy_version
    for node in nodes:
        node.policy_version = policy_version
    # Tool calls made on a shared prefix happened once; count each path's calls after its branch point only.
    own_calls = sum(len(p.tool_calls) - p.inherited_calls for p in ps.paths)
    metrics = {
        MK.GROUP_STEP: float(step),
        MK.GROUP_TOKENS_GENERATED: float(sum(p.generated for p in ps.paths) + ps.premonitor_tokens),
        MK.GROUP_TOOL_CALLS: float(own_calls + ps.premonitor_tool_calls),
        MK.GROUP_INITIAL_SAMPLES: float(sum(p.kind == "initial" for p in ps.paths)),
        MK.GROUP_FILLUPS: float(sum(p.kind == "fillup" for p in ps.paths)),
        MK.GROUP_BRANCHES: float(sum(ps.branches_by_depth.values())),
        MK.GROUP_BRANCH_CANDIDATES: float(len(ps.decisions)),
        MK.GROUP_BRANCH_OPPORTUNITIES: float(sum(d["cap"] for d in ps.decisions)),
        MK.GROUP_MAX_DEPTH: float(max(p.depth for p in ps.paths)),
        **{MK.GROUP_BRANCHES_AT_DEPTH.format(d): float(n) for d, n in sorted(ps.branches_by_depth.items())},
    }
    return Group(
        prompt_index=ps.task_index,
        prompt_ids=ps.prompt_ids,
        trajectories=trajs,
        task=ps.task,
        nodes=nodes,
        metrics=metrics,
        policy_version=policy_version,
        decisions=ps.decisions,
    )
